"""Where the host's time goes in a capacity run: a summary of ``py-spy record --format raw --threads`` samples of
``benchmarks/load_test.py``, thread by thread, the main thread's own split to the measured runs (its stacks through
``run_k``: the engine's start and warmup left out).

    py-spy record -r 100 --nonblocking --threads --format raw -o RAW.txt -- \\
        python benchmarks/load_test.py ... --out RUN.json
    python benchmarks/host_profile.py RAW.txt --load-test RUN.json --out SUMMARY.json

py-spy leaves out samples of a thread it sees idle (blocked in a system call), so a thread's samples over the run's
seconds times the rate is its busy share; ``--gil`` (py-spy's) keeps only the thread holding the GIL.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path
from typing import Any

# The threads a run has: the load test's own (its main thread in the runs) and the scheduler's (its own thread, each
# lane's device thread: the generator's, and the F0 lane's where the engine has one); the rest (cuDNN's choosing
# threads, inductor's) belong to the start.
RUN_THREADS = ("MainThread (in the runs)", "hift-batch-call", "hift-f0-call", "hift-scheduler")
# A frame as py-spy writes it: "function (path/file.py:line)".
FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def thread_name(first: str) -> str:
    """A stack's thread, without its id: "thread (0x7f..): MainThread" -> "MainThread"; pool threads by prefix."""
    name = first.split(": ", 1)[1] if ": " in first else first
    return re.sub(r"_\d+$", "", name)


def function(frame: str, with_line: bool = False) -> str:
    """``file:function`` (``file:line function`` with ``with_line``), the file without its folders."""
    m = FRAME.match(frame)
    if not m:
        return frame
    file = Path(m["file"]).name
    return f"{file}:{m['line']} {m['fn']}" if with_line and m["line"] else f"{file} {m['fn']}"


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) stacks: each "frame;frame;... count", outermost first."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def top(stacks: list[tuple[list[str], int]], n: int) -> dict[str, Any]:
    """The ``n`` largest self (innermost frame, with its line) and inclusive (once a stack) shares of ``stacks``."""
    total = sum(c for _, c in stacks) or 1
    own: collections.Counter[str] = collections.Counter()
    within: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        own[function(frames[-1], with_line=True)] += count
        for name in {function(f) for f in frames[1:]}:
            within[name] += count
    return {"samples": total, "self": {k: round(v / total, 3) for k, v in own.most_common(n)},
            "inclusive": {k: round(v / total, 3) for k, v in within.most_common(n)}}


def summarize(stacks: list[tuple[list[str], int]], rate_hz: float, run_seconds: float | None,
              window: str = "run_k", n: int = 20) -> dict[str, Any]:
    """Samples per thread; the main thread's within ``window`` (a function of the load test), split by function;
    each other thread's, likewise. With ``run_seconds``: each of :data:`RUN_THREADS`' samples as a share of the
    runs."""
    by_thread: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for frames, count in stacks:
        name = thread_name(frames[0])
        if name == "MainThread":
            in_runs = any(f.startswith(window + " ") for f in frames)  # a frame is "function (file:line)"
            name = "MainThread (in the runs)" if in_runs else "MainThread (start, warmup)"
        by_thread[name].append((frames, count))
    out: dict[str, Any] = {"rate_hz": rate_hz, "run_seconds": run_seconds, "threads": {}}
    counts = {name: sum(c for _, c in group) for name, group in by_thread.items()}
    everything = sum(counts.values())
    for name, group in sorted(by_thread.items(), key=lambda kv: -counts[kv[0]]):
        samples = counts[name]
        row: dict[str, Any] = {"samples": samples, "seconds": round(samples / rate_hz, 1)}
        if run_seconds and name in RUN_THREADS:
            row["share_of_the_runs"] = round(samples / rate_hz / run_seconds, 3)
        if samples >= 0.01 * everything:
            row.update(top(group, n))
        out["threads"][name] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", type=Path, help="py-spy record --format raw --threads output")
    p.add_argument("--rate", type=float, default=100.0, help="the sampling rate py-spy ran at (-r)")
    p.add_argument("--load-test", type=Path, help="the load test's JSON: the runs' seconds (wall_s) from there")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    seconds = None
    if args.load_test:
        result = json.loads(args.load_test.read_text())
        seconds = sum(row["wall_s"] for config in result["configs"].values() for row in config["runs"])
    summary = summarize(read_raw(args.raw), args.rate, seconds, n=args.top)
    summary["raw"] = args.raw.name
    text = json.dumps(summary, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    for name, row in summary["threads"].items():
        print(f"{name}: {row['samples']} samples ({row['seconds']} s"
              + (f", {row['share_of_the_runs']:.0%} of the runs)" if "share_of_the_runs" in row else ")"))
        for fn, share in list(row.get("self", {}).items())[:8]:
            print(f"    {share:6.1%}  {fn}")


if __name__ == "__main__":
    main()
