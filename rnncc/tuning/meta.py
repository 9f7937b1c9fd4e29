"""MetaSchedule (XGBoost cost model) on the components it can tune.

Tunable components are those with static shapes: the recurrent GEMM of a step and, with
``input_gemm`` off, the per-step input GEMM. The input GEMM of all steps at once has a
run-time size (T*N rows): MetaSchedule samples tile sizes that
divide static extents, so it keeps its rule-based schedule.

Trials run in rounds of at most :data:`ROUND` with one builder, runner, cost model and
database throughout: between rounds the time budget is checked and progress printed, and the
database (on disk, JSON) keeps every measured record, so a stopped tune resumes from them.
Measurement is local, or on the servers of a TVM RPC tracker (``rpc="host:port:key"``).
"""

from __future__ import annotations

import logging
import os
import time

from ..errors import ConfigError

#: Trials a round (a MetaSchedule tune call).
ROUND = 32


def tunable(lowered) -> dict:
    """{component key: PrimFunc} of the lowered layer's components MetaSchedule can tune."""
    out = {}
    for key, (func, role) in lowered.components.items():
        if role == "gemm" and all(hasattr(d, "value") for p in func.params for d in p.shape):
            out[key] = func
    return out


def _target(target, cores: int):
    import tvm

    if target.kind.name != "llvm":
        return target
    return tvm.target.Target({**dict(target.export()), "num-cores": cores})


def runner_for(rpc: str | None, timeout: float):
    """A MetaSchedule runner: local, or through the tracker ``host:port:key``."""
    from tvm.s_tir import meta_schedule as ms

    evaluator = ms.runner.EvaluatorConfig(number=10, repeat=3, min_repeat_ms=0,
                                          enable_cpu_cache_flush=False)
    if rpc is None:
        return ms.runner.LocalRunner(timeout_sec=timeout, evaluator_config=evaluator)
    try:
        host, port, key = rpc.rsplit(":", 2)
        port = int(port)
    except ValueError as err:
        raise ConfigError(f"--rpc must be HOST:PORT:KEY, got {rpc!r}") from err
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key,
                                 session_timeout_sec=int(timeout))
    try:
        servers = config.count_num_servers(allow_missing=False)
    except Exception as err:  # noqa: BLE001 - a tracker that is not there
        raise ConfigError(f"RPC tracker {host}:{port} with key {key!r} is not reachable or has "
                          f"no servers ({str(err).strip().splitlines()[-1]})") from err
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator,
                               max_workers=max(1, servers))


def tune(funcs: dict, target, work_dir: str, trials: int, deadline: float, rpc=None,
         progress=print):
    """Tune ``funcs`` ({key: PrimFunc}) for ``target`` until ``trials`` records are in the
    database of ``work_dir`` or ``deadline`` (time.monotonic()) passes. Returns the database."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.logging import get_loggers_from_work_dir

    from ..schedules.tuned import workload

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    os.makedirs(work_dir, exist_ok=True)
    cores = max(1, os.cpu_count() or 1)
    tgt = _target(target, cores)
    database = ms.database.JSONDatabase(work_dir=work_dir)
    builder = ms.builder.LocalBuilder(max_workers=cores, timeout_sec=120.0)
    runner = runner_for(rpc, 30.0)
    cost_model = ms.cost_model.XGBModel(num_tuning_cores=cores)
    names = sorted(funcs)
    loggers = get_loggers_from_work_dir(work_dir, names)
    done = len(database)
    if done:
        progress(f"meta_schedule: resuming with {done} measured records in {work_dir}")
    round_no = 0
    while done < trials:
        left = deadline - time.monotonic()
        if left <= 0:
            progress(f"meta_schedule: time budget spent after {done}/{trials} trials")
            break
        count = min(ROUND, trials - done)
        contexts = [ms.TuneContext(mod=workload(funcs[name]), target=tgt,
                                   space_generator="post-order-apply",
                                   search_strategy="evolutionary", task_name=name,
                                   rand_state=round_no * 7919 + i, num_threads=cores,
                                   logger=loggers[i]).clone()
                    for i, name in enumerate(names)]
        ms.tune_tasks(tasks=contexts, task_weights=[1.0] * len(contexts), work_dir=work_dir,
                      max_trials_global=count, num_trials_per_iter=count, builder=builder,
                      runner=runner, database=database, cost_model=cost_model)
        round_no += 1
        now = len(database)
        if now == done:  # the search space gave nothing new
            progress("meta_schedule: no new candidates; stopping")
            break
        done = now
        progress(f"meta_schedule: {done}/{trials} trials, best "
                 + ", ".join(f"{name} {_best_us(database, funcs[name])}" for name in names)
                 + f" | {max(0, deadline - time.monotonic()):.0f} s left")
    return database


def _best_us(database, func) -> str:
    from ..schedules.tuned import workload

    mod = workload(func)
    if not database.has_workload(mod):
        return "-"
    top = database.get_top_k(database.commit_workload(mod), 1)
    if not top or not top[0].run_secs:
        return "none valid"
    secs = [float(s) for s in top[0].run_secs]
    return f"{1e6 * sum(secs) / len(secs):.2f} us"


def prune(database, destination_dir: str) -> str:
    """Write the best record of each workload to ``destination_dir`` (a JSON database)."""
    from tvm.s_tir import meta_schedule as ms

    os.makedirs(destination_dir, exist_ok=True)
    database.dump_pruned(ms.database.JSONDatabase(work_dir=destination_dir))
    return destination_dir
