"""Busy and idle time of every GPU in a jax.profiler trace, and its memsets by HLO op.

    python scripts/trace_device_time.py TRACE_DIR STEPS

Reads the newest ``*.xplane.pb`` under TRACE_DIR (e.g. the directory of
``examples/train_moe_lm.py --profile``) and prints, per GPU: the time from its
first to its last event on the stream lines, the time at least one event ran
(kernels, memsets and copies of every module) and the rest (idle), per step;
then the memsets by the HLO op that issued them (cuDNN's attention, for one,
zeroes its workspace inside its custom call). `--profile`'s breakdown counts the
train step's own kernels only; this counts everything on the streams.
"""

from __future__ import annotations

import collections
import glob
import os
import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    trace_dir, steps = argv[0], int(argv[1])
    from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit(f"no *.xplane.pb under {trace_dir}")
    data = ProfileData.from_file(max(paths, key=os.path.getmtime))
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events, memset_ns, memset_count = [], collections.Counter(), collections.Counter()
        for line in plane.lines:
            if not line.name.lower().startswith("stream"):
                continue
            for event in line.events:
                start = float(event.start_ns)
                events.append((start, start + float(event.duration_ns)))
                if "memset" in event.name.lower():
                    op = str(dict(event.stats).get("hlo_op", "?"))
                    memset_ns[op] += float(event.duration_ns)
                    memset_count[op] += 1
        if not events:
            continue
        events.sort()
        busy, end = 0.0, float("-inf")
        for start, stop in events:
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        span = max(stop for _, stop in events) - events[0][0]
        print(f"{plane.name}: {len(events)} events; per step: span {span / 1e6 / steps:.2f} ms, "
              f"busy {busy / 1e6 / steps:.2f} ms, idle {(span - busy) / 1e6 / steps:.2f} ms")
        print(f"  memsets: {sum(memset_ns.values()) / 1e3 / steps:.1f} us a step in "
              f"{sum(memset_count.values()) / steps:g}; by HLO op:")
        for op, ns in memset_ns.most_common():
            print(f"  {op}: {ns / 1e3 / steps:.1f} us a step, {memset_count[op] / steps:g} a step")


if __name__ == "__main__":
    main()
