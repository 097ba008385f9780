#!/usr/bin/env python3
"""A queue model of the fused mm_rs's narrow peer tiles at 512 x 14336 x 8192
(world 2): when does the last partial reach the peer, for a cut of each
128-row tile's 8192 columns into 34 tiles of 232 to 256 columns?

Inputs, both measured: a tile's k-loop ends at ~0.6125 us per column of its
width (v19 traces: 240 wide ~147 us, 248 ~152, 256 ~157, docs/history/KERNELS.md)
and the link carries R bytes/us (push_probe.cu: ~375-400 GB/s with nothing
else running; the fused kernel's traces ~320-350). Each tile's 128 x w bf16
partial joins one FIFO link when its k-loop ends. Prints the one-width cut
and the best cuts of up to four widths.

    python3 bench/probes/stagger_model.py [GB/s]
"""
import sys

US_PER_COL = 147.0 / 240
TILES, COLS = 34, 8192
WIDTHS = (224, 232, 240, 248, 256)


def last_push(cut, rate):
    """us at which the last byte crosses; cut: {width: tiles per row tile}."""
    t = 0.0
    for end, nbytes in sorted((US_PER_COL * w, 2 * 128 * w * 2 * c) for w, c in cut.items() if c):
        t = max(t, end) + nbytes / rate
    return t


def cuts(widths=WIDTHS, tiles=TILES, cols=COLS):
    """Every {width: count} with `tiles` tiles covering `cols` columns."""
    if not widths:
        if tiles == 0 and cols == 0:
            yield {}
        return
    w, rest = widths[0], widths[1:]
    for c in range(min(tiles, cols // w) + 1):
        for cut in cuts(rest, tiles - c, cols - c * w):
            yield {w: c, **cut}


def main():
    rate = float(sys.argv[1]) * 1e3 if len(sys.argv) > 1 else 380e3  # bytes per us
    one = {240: 30, 248: 4}
    print(f"link {rate / 1e3:.0f} GB/s; last push at (us from the kernel's start):")
    print(f"  {last_push(one, rate):6.1f}  {one} (v19-v20)")
    ranked = sorted((last_push(c, rate), sorted((w, n) for w, n in c.items() if n)) for c in cuts())
    for t, cut in [r for r in ranked if len(r[1]) <= 4][:5]:
        print(f"  {t:6.1f}  {dict(cut)}")


if __name__ == "__main__":
    main()
