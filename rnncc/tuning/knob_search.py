"""A search over the persistent kernel's knobs (:data:`rnncc.schedules.persistent.knobs.KNOBS`).

Candidates are the planner's default, a starting point (a nearby configuration's tuned knobs),
each synchronisation variant, each number of batch groups, smaller grids (on sm_90 also groups
of at most a cluster's 8 or 16 blocks, exchanging h within the cluster), other block sizes,
more weights in shared memory, the input projection fused or not, the products on tensor
cores or not (float16, bfloat16, TF32), and, where the kernel computes its input projections
by default, each number of batch groups with more of W_hh in shared memory (room for the
overlapped projection, where the planner's estimate or ptxas found none); knobs that give the
same plan are measured once. Candidates build in parallel (one process each, the machine's
cores); each is then run in a separate measuring process on fresh random inputs, its output
checked against the float64 reference (a wrong result is rejected with its error) and only
then timed (CUDA-graph captured, median). A candidate that fails to build, crashes or hangs
(killed after a timeout) is skipped with the reason. Each result is appended to
``results.jsonl`` in the work directory, and a resumed search skips what it has.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import multiprocessing
import os
import time

from ..errors import RnnccError
from .log import precision

#: Relative error against float64 (of the same rounded inputs) a candidate must stay under, by
#: precision (:func:`.log.precision`).
TOLERANCE = {"float32": 1e-5, "tf32": 5e-3, "float16": 2e-3, "bfloat16": 1e-2}
#: Seconds a candidate's check and timing may take before it counts as hung.
MEASURE_TIMEOUT = 40.0


def candidates(problem, gpu, start: dict | None = None) -> list[dict]:
    """Knob sets to try, the default ({}) first and ``start`` second, one a distinct plan."""
    from ..cells.autodiff import mean_levels
    from ..schedules import persistent
    from ..schedules.persistent.knobs import OVERLAP_ROOM, SYNCS, WARPS, fuses_input, plan_for
    from ..schedules.persistent.planner import REG_MARGIN

    def plan_of(knobs):
        try:  # as rnncc compile plans it
            return plan_for(problem, gpu, knobs, knobs.get("reg_margin", REG_MARGIN))
        except persistent.Unfit:
            return None

    base = plan_of({})
    if base is None:
        return []
    tries = [{}, dict(start or {})]
    tries += [{"sync": s} for s in SYNCS]
    groups = [d for d in range(1, problem.batch + 1) if problem.batch % d == 0]
    tries += [{"batch_groups": d} for d in groups]
    for frac in (0.75, 0.5, 0.375, 0.25):
        blocks = max(1, int(base.blocks * frac))
        tries += [{"max_blocks": blocks, "sync": s} for s in ("tagged", "barrier")]
    for size in sorted({gpu.cluster, gpu.wide_cluster} - {1}):  # groups of a cluster's blocks
        if base.group_blocks > size:  # (planner: "A cluster a group"), fewer than it estimates
            tries += [{"max_blocks": size * base.batch_groups, "sync": "cluster"}]
    tries += [{"warps": w} for w in WARPS]
    tries += [{"reg_margin": REG_MARGIN + 32}, {"input_rows": 0}, {"input_rows": 32}]
    tries += [{"input_steps": 0}, {"input_steps": 4}, {"input_steps": 8}]
    tries += [{"mma": not base.mma}, {"warps": 4, "mma": True}]
    if base.lane_groups > 1 or base.lane_bytes < 16:  # small K: lane groups or narrow chunks
        tries += [{"lane_groups": base.lane_groups == 1}]
    if mean_levels(problem.cell):  # a step's means as each block's sums, or as units' values
        tries += [{"mean_partials": not base.mean_partials}]
    if fuses_input(problem):  # W_hh's chunks moved to make room for the overlap, by groups
        tries += [{"batch_groups": d, "reg_margin": REG_MARGIN + room} for d in groups
                  for room in OVERLAP_ROOM[1:]]
    if base.smem_chunks > 1:
        tries += [{"unroll": base.smem_chunks}]
    out, seen = [], set()
    for knobs in tries:
        found = plan_of(knobs)
        if found is None:
            continue
        key = json.dumps(dataclasses.asdict(found), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(knobs)
    return out


def _build(args):
    """Worker: compile one candidate, export it; (path, None) or (None, why)."""
    spec, knobs, path = args
    try:
        import rnncc

        module = rnncc.compile(spec["cell"], spec["input_size"], spec["hidden_size"],
                               spec["batch"], dtype=spec["dtype"], target="cuda",
                               arch=spec["arch"], sms=spec["sms"], knobs=knobs,
                               persistent="on", tuning="off",
                               allow_tf32=spec.get("allow_tf32", False),
                               directions=spec.get("directions", 1),
                               layers=spec.get("layers", 1))
        module.export(path)
        return path, None
    except RnnccError as err:
        return None, str(err)
    except Exception as err:  # noqa: BLE001 - any failure is the candidate's
        return None, f"{type(err).__name__}: {str(err).strip().splitlines()[-1:]}"


def _measure(args):
    """Worker: check a built candidate against float64, then time it (ms a call)."""
    path, steps, tol = args
    import torch

    import rnncc
    from rnncc import bench, reference

    module = rnncc.load(path)
    cell = rnncc.cells.get(module.cell) if module.cell in rnncc.cells.names() else None
    x64, w64 = bench.random_problem(module, steps, seed=1234)
    dt = getattr(torch, module.dtype)
    x = torch.tensor(x64, dtype=dt, device="cuda")
    weights = {k: torch.tensor(v, dtype=dt, device="cuda") for k, v in w64.items()}
    packed = module.pack(weights, entry="persistent")
    y, _ = module(x, packed)
    torch.cuda.synchronize()
    if cell is not None:
        given = (x.double().cpu().numpy(),  # the inputs as rounded
                 {k: v.double().cpu().numpy() for k, v in weights.items()})
        ref, _ = reference.run_module(cell, *given, module.directions, module.layers)
        error = reference.relative_error(y.double().cpu().numpy(), ref)  # NumPy has no bf16
        if not error < tol:
            return None, f"wrong result: relative error {error:.2e} (limit {tol:.0e})"
    else:
        error = None
    ms = bench.time_gpu(module, steps, cudnn=False, entry="persistent")["rnncc"]
    return {"ms": ms, "error": error, "plan": module.metadata["schedule"]["persistent"]}, None


class _Measurer:
    """One measuring process at a time; a hung candidate's process is killed and replaced."""

    def __init__(self):
        self.pool = None

    def run(self, args):
        if self.pool is None:
            self.pool = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        future = self.pool.submit(_measure, args)
        try:
            return future.result(timeout=MEASURE_TIMEOUT)
        except cf.TimeoutError:
            self.close(kill=True)
            return None, f"timed out after {MEASURE_TIMEOUT:.0f} s (killed)"
        except Exception as err:  # noqa: BLE001 - a crashed process or a runtime error
            self.close(kill=True)
            return None, f"failed: {type(err).__name__}: {str(err).strip()[-300:]}"

    def close(self, kill=False):
        if self.pool is None:
            return
        if kill:
            for proc in list(getattr(self.pool, "_processes", {}).values()):
                proc.kill()
        self.pool.shutdown(wait=not kill, cancel_futures=True)
        self.pool = None


def search(problem, spec: dict, gpu, work_dir: str, steps: int, deadline: float,
           start: dict | None = None, progress=print) -> list[dict]:
    """Measure the candidates (skipping those ``results.jsonl`` has); returns every result:
    {"knobs", "ms" or None, "why" (when rejected), "plan"}."""
    os.makedirs(work_dir, exist_ok=True)
    journal = os.path.join(work_dir, "results.jsonl")
    results = []
    if os.path.exists(journal):
        with open(journal) as f:
            for line in f:
                try:
                    results.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
    done = {json.dumps(r["knobs"], sort_keys=True) for r in results}
    todo = [k for k in candidates(problem, gpu, start) if json.dumps(k, sort_keys=True)
            not in done]
    if results:
        progress(f"persistent knobs: resuming, {len(results)} measured, {len(todo)} to go")
    if not todo:
        return results
    tol = TOLERANCE[precision(problem, "cuda")]
    cores = max(1, min(len(todo), os.cpu_count() or 1))
    measurer = _Measurer()
    total = len(results) + len(todo)
    builds = cf.ProcessPoolExecutor(cores, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [builds.submit(_build, (spec, k, os.path.join(work_dir, f"cand{i}.so")))
                   for i, k in enumerate(todo)]
        for knobs, future in zip(todo, futures):
            if time.monotonic() > deadline:
                progress("persistent knobs: time budget spent")
                break
            path, why = future.result()
            out = None
            if path is not None:
                out, why = measurer.run((path, steps, tol))
                os.remove(path)
            entry = {"knobs": knobs, "ms": out["ms"] if out else None,
                     "error": out["error"] if out else None,
                     "plan": out["plan"] if out else None, "why": why}
            results.append(entry)
            with open(journal, "a") as f:
                f.write(json.dumps(entry, sort_keys=True) + "\n")
            best = min((r["ms"] for r in results if r["ms"] is not None), default=None)
            shown = f"{out['ms'] * 1e3 / steps:.2f} us/step" if out else f"skipped: {why}"
            progress(f"persistent knobs {len(results)}/{total}: {knobs or 'default'} -> {shown}"
                     + (f" | best {best * 1e3 / steps:.2f} us/step" if best else "")
                     + f" | {max(0, deadline - time.monotonic()):.0f} s left")
    finally:
        builds.shutdown(wait=False, cancel_futures=True)
        measurer.close()
    return results
