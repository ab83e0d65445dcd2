"""Ways of keeping the caches on the device, timed as CUDA-graph replays of the 24-frame generator step at a few
batch sizes: the plain graph (caches bound as device buffers, next caches into others: no slots), the exported slot
form (``packed``: one flat pool read and written element by element) and, to locate costs, one pool per cache
read with a Gather and written with a ScatterND by row (``per_cache``; ``read_only``, ``write_only``: one half of
it; ``copies_only``: the gathers and scatters without the model). Not a test: it reports figures.

    python benchmarks/slot_forms.py --artifacts DIR --out R.json [--batches 1,64,256] [--tf32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np


def replay_ms(session, feed: dict[str, np.ndarray], device_out: dict[str, tuple[list[int], Any]],
              inplace: dict[str, str], graph_id: int, runs: int, ort) -> dict[str, float]:
    values = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feed.items()}
    binding = session.io_binding()
    for k, v in values.items():
        binding.bind_ortvalue_input(k, v)
    outs = {}
    for name, (shape, dtype) in device_out.items():
        if name in inplace:  # bound to its input's own buffer
            v = values[inplace[name]]
            binding.bind_output(name, "cuda", 0, dtype, shape, v.data_ptr())
        else:
            outs[name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", 0)
            binding.bind_ortvalue_output(name, outs[name])
    ro = ort.RunOptions()
    ro.add_run_config_entry("gpu_graph_id", str(graph_id))
    for _ in range(4):
        session.run_with_iobinding(binding, ro)
    binding.synchronize_outputs()
    lat = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run_with_iobinding(binding, ro)
        binding.synchronize_outputs()
        lat.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(float(np.median(lat)), 3), "p95_ms": round(float(np.percentile(lat, 95)), 3)}


def per_cache_rows(model: Any, layout: list[dict[str, Any]], read: bool = True, write: bool = True) -> Any:
    """One pool per cache (``pool.NAME [S, *shape]``), read with one Gather each and written with one ScatterND each
    indexed by row (``write_slots [B, 1]``): the form that showed ScatterND's one thread per index."""
    import onnx
    from onnx import TensorProto, helper

    from hift_export.graphs import CACHE_PREFIX, NEXT_PREFIX

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    cache_inputs = {CACHE_PREFIX + e["name"] for e in layout} if read else set()
    inputs = [i for i in g.input if i.name not in cache_inputs]
    del g.input[:]
    pools = [helper.make_tensor_value_info(f"pool.{e['name']}", TensorProto.FLOAT, ["pool_rows", *e["shape"]])
             for e in layout]
    g.input.extend(inputs + ([helper.make_tensor_value_info("read_slots", TensorProto.INT64, ["batch"])] if read else [])
                   + ([helper.make_tensor_value_info("write_slots", TensorProto.INT64, ["batch", 1])] if write else [])
                   + pools)
    head = [helper.make_node("Gather", [f"pool.{e['name']}", "read_slots"], [CACHE_PREFIX + e["name"]], axis=0)
            for e in layout] if read else []
    tail = [helper.make_node("ScatterND", [f"pool.{e['name']}", "write_slots", NEXT_PREFIX + e["name"]],
                             [f"pool_out.{e['name']}"]) for e in layout] if write else []
    if write:
        outputs = [o for o in g.output if not o.name.startswith(NEXT_PREFIX)]
        del g.output[:]
        g.output.extend(outputs + [helper.make_tensor_value_info(f"pool_out.{e['name']}", TensorProto.FLOAT,
                                                                 ["pool_rows", *e["shape"]]) for e in layout])
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(head + nodes + tail)
    return out


def copies_only(layout: list[dict[str, Any]]) -> Any:
    """No model: each cache's rows gathered from its pool and scattered back into it (the slot form's pure cost)."""
    from onnx import TensorProto, helper

    nodes, inputs, outputs = [], [], []
    for e in layout:
        n = e["name"]
        inputs.append(helper.make_tensor_value_info(f"pool.{n}", TensorProto.FLOAT, ["pool_rows", *e["shape"]]))
        outputs.append(helper.make_tensor_value_info(f"pool_out.{n}", TensorProto.FLOAT, ["pool_rows", *e["shape"]]))
        nodes += [helper.make_node("Gather", [f"pool.{n}", "read_slots"], [f"rows.{n}"], axis=0),
                  helper.make_node("ScatterND", [f"pool.{n}", "write_slots", f"rows.{n}"], [f"pool_out.{n}"])]
    slots = [helper.make_tensor_value_info("read_slots", TensorProto.INT64, ["batch"]),
             helper.make_tensor_value_info("write_slots", TensorProto.INT64, ["batch", 1])]
    graph = helper.make_graph(nodes, "copies_only", slots + inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    import onnx
    import onnxruntime as ort

    from hift_export.slots import slotted_model
    from hift_runtime.manifest import GENERATOR_STEP, read_manifest
    from hift_runtime.sessions import CudaOptions, _zero_step_feed
    from hift_runtime.contract import StreamConstants

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    art = Path(args.artifacts)
    manifest = read_manifest(art, verify=None)
    c = StreamConstants.from_manifest(manifest.config, manifest.step)
    layout = manifest.step["generator_caches"]
    plain_path = manifest.path(GENERATOR_STEP)
    model = onnx.load(str(plain_path))  # with its external weights
    paths = {"plain": plain_path}
    builds = {"packed": lambda m: slotted_model(m, layout, False),
              "per_cache": lambda m: per_cache_rows(m, layout),
              "read_only": lambda m: per_cache_rows(m, layout, write=False),
              "write_only": lambda m: per_cache_rows(m, layout, read=False)}
    for name, build in builds.items():
        paths[name] = art / f"variant_{name}.onnx"
        onnx.save(build(model), str(paths[name]))
    paths["copies_only"] = art / "variant_copies_only.onnx"
    onnx.save(copies_only(layout), str(paths["copies_only"]))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    provider = [("CUDAExecutionProvider", CudaOptions(use_tf32=args.tf32).provider_options()
                 | {"enable_cuda_graph": "1"})]
    sessions = {k: ort.InferenceSession(str(v), opts, providers=provider) for k, v in paths.items()}
    result: dict[str, Any] = {"command": "python benchmarks/slot_forms.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items()), "onnxruntime": ort.__version__,
        "nodes": {k: len(onnx.load(str(v), load_external_data=False).graph.node) for k, v in paths.items()},
        "by_batch": {}}
    rng = np.random.default_rng(0)
    row = sum(int(np.prod(e["shape"])) for e in layout)
    graph_id = 0
    for batch in [int(b) for b in args.batches.split(",")]:
        feed = _zero_step_feed(c, 24, batch)
        feed["mel"] -= 5.0
        feed["f0"] += 180.0
        feed["noise"][...] = rng.random(feed["noise"].shape, dtype=np.float32)
        feed["first"][...] = False
        audio = {"audio": ([batch, 24 * c.samples_per_frame], np.float32), "phase_out": ([batch, c.num_sines],
                                                                                         np.float64)}
        rows = batch + 2
        caches = {f"cache.{e['name']}": np.zeros((batch, *e["shape"]), np.float32) for e in layout}
        nxt = {f"next.{e['name']}": ([batch, *e["shape"]], np.float32) for e in layout}
        pools = {f"pool.{e['name']}": np.zeros((rows, *e["shape"]), np.float32) for e in layout}
        pool_out = {f"pool_out.{e['name']}": ([rows, *e["shape"]], np.float32) for e in layout}
        arms = {
            "plain": ({**feed, **caches}, {**audio, **nxt}, {}),
            "packed": ({**feed, "slots": np.arange(2, batch + 2, dtype=np.int64),
                        "pool": np.zeros(rows * row, np.float32)}, {**audio, "pool_out": ([rows * row], np.float32)},
                       {"pool_out": "pool"}),
            "per_cache": ({**feed, "read_slots": np.arange(2, batch + 2, dtype=np.int64),
                           "write_slots": np.arange(2, batch + 2, dtype=np.int64)[:, None], **pools},
                          {**audio, **pool_out}, {k: "pool." + k[len("pool_out."):] for k in pool_out}),
        }
        slots = {"read_slots": np.arange(2, batch + 2, dtype=np.int64),
                 "write_slots": np.arange(2, batch + 2, dtype=np.int64)[:, None]}
        arms["copies_only"] = ({**slots, **pools}, pool_out, arms["per_cache"][2])
        arms["read_only"] = ({**feed, "read_slots": slots["read_slots"], **pools}, {**audio, **nxt}, {})
        arms["write_only"] = ({**feed, **caches, "write_slots": slots["write_slots"], **pools}, {**audio, **pool_out},
                              arms["per_cache"][2])
        result["by_batch"][str(batch)] = {}
        for name, (f, outs, inplace) in arms.items():
            graph_id += 1
            t = replay_ms(sessions[name], f, outs, inplace, graph_id, args.runs, ort)
            result["by_batch"][str(batch)][name] = t
        print(batch, json.dumps(result["by_batch"][str(batch)]), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
