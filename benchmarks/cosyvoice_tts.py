"""The vocoder in upstream CosyVoice3's own ``tts(stream=True)`` loop: upstream's HiFT (re-vocoding the whole mel at
every chunk) against this runtime behind ``hift_runtime.cosyvoice.use_streaming_vocoder``, on the same utterances and
in the same process. Not a test: it reports figures.

    python benchmarks/cosyvoice_tts.py --artifacts DIR --upstream ../shared/upstream-cosyvoice --seconds 10,60 \\
        --out benchmarks/results/cosyvoice-tts-2core.json [--device cpu|cuda] [--engine ort|compiled]

DIR: an export of the checkpoint upstream loads (``--checkpoint``, default the upstream runner's). For each length:
the vocoder's total time in ``tts()`` (the sum of its ``token2wav`` calls, flow stub included, ~0), the time to the
first audio (the first chunk's vocoder call) and each chunk's vocoder latency, upstream's and ours, with their ratio;
the audio of both compared. The stub LLM yields every token at once and the stub flow returns slices of a given mel,
so what is timed is the vocoder alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def timed_tts(upstream: Any, model: Any) -> dict[str, Any]:
    """Run ``model.tts(stream=True)``, timing each ``token2wav`` call (what the vocoder costs per chunk)."""
    calls: list[float] = []
    inner = model.token2wav

    def token2wav(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        calls.append(time.perf_counter() - t0)
        return out

    model.token2wav = token2wav
    started = time.perf_counter()
    chunks = [out["tts_speech"] for out in model.tts(stream=True)]
    import torch

    return {"audio": torch.cat(chunks, dim=1)[0].numpy(), "chunk_s": calls, "wall_s": time.perf_counter() - started,
            "chunk_frames": np.diff([0, *[c["mel"] for c in model.flow.calls]]).tolist()}


def summary(run: dict[str, Any]) -> dict[str, Any]:
    ms = [round(s * 1e3, 1) for s in run["chunk_s"]]
    return {"vocoder_total_s": round(sum(run["chunk_s"]), 3), "first_audio_ms": ms[0], "chunk_ms": ms,
            "chunk_frames": run["chunk_frames"], "tts_wall_s": round(run["wall_s"], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--upstream", required=True, help="the folder of upstream's code and its run_token2wav.py")
    p.add_argument("--checkpoint", default=None, help="the hift.pt upstream loads (default: the runner's)")
    p.add_argument("--seconds", default="10,60")
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine", default="ort")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sys.path.insert(0, os.path.abspath(args.upstream))
    import run_token2wav as upstream  # noqa: E402  (upstream's runner: its stubs and model classes)
    import torch

    from hift_runtime import open_vocoder
    from hift_runtime.cosyvoice import use_streaming_vocoder
    from hift_runtime.metrics import max_abs, snr_db

    checkpoint = args.checkpoint or upstream.CHECKPOINT
    lengths = [float(s) for s in args.seconds.split(",")]
    hift = upstream.build_upstream_hift(1986)  # upstream's noise table comes with it (the seed)
    upstream.load_with_upstream(hift, checkpoint, torch.zeros(1, 80, 2))
    import tempfile
    import warnings

    table = Path(tempfile.mkdtemp()) / "upstream-noise.npy"  # the rows the longest utterance reads
    np.save(table, hift.m_source.l_sin_gen.sine_waves[0, :int(max(lengths) * 24000) + 480 * 16].numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a table shorter than upstream's: these streams never wrap
        ours_vocoder = open_vocoder(args.artifacts, device=args.device, engine=args.engine, noise_table=table)
    ours_vocoder.warmup()
    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": "python benchmarks/cosyvoice_tts.py " + " ".join(sys.argv[1:]),
                              "torch_threads": torch.get_num_threads(), "engine": ours_vocoder.backend.name,
                              "runs": {}}
    for seconds in lengths:
        frames = int(seconds * 50) // 2 * 2
        mel = upstream.load_mel(upstream.DEFAULT_MEL if Path(upstream.DEFAULT_MEL).is_file()
                                else str(Path(__file__).parent.parent / "examples" / "demo_mel.npy"), frames)
        mel_t = torch.from_numpy(mel)[None].to(next(hift.parameters()).device)  # the flow's output, where HiFT is
        theirs_model = upstream.CosyVoice3Model(upstream.StubLLM(frames // 2), upstream.StubFlow(mel_t), hift)
        ours_model = use_streaming_vocoder(upstream.CosyVoice3Model(
            upstream.StubLLM(frames // 2), upstream.StubFlow(mel_t), torch.nn.Identity()), ours_vocoder)
        ours = timed_tts(upstream, ours_model)
        theirs = timed_tts(upstream, theirs_model)
        row = {"frames": frames, "upstream": summary(theirs), "ours": summary(ours),
               "ratio_vocoder_total": round(sum(theirs["chunk_s"]) / max(sum(ours["chunk_s"]), 1e-9), 2),
               "ratio_first_audio": round(theirs["chunk_s"][0] / max(ours["chunk_s"][0], 1e-9), 2),
               "audio_vs_upstream": {"max_abs": float(f"{max_abs(ours['audio'], theirs['audio']):.3g}"),
                                     "snr_db": round(snr_db(ours["audio"], theirs["audio"]), 1)}}
        result["runs"][f"{seconds:g}s"] = row
        print(json.dumps({f"{seconds:g}s": row}), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
