"""`--workers` on Ray: the same predictions as one process, a killed worker loses and repeats nothing.

All Ray tests share one local cluster (2 CPUs, loopback only), started once and stopped at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from ripplekv.errors import UserError
from ripplekv.pipeline import distributed, evaluate
from tests.conftest import without_peak_memory

pytest.importorskip("ray")

TASKS = ("niah", "squad")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = distributed.import_ray(local=True)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import the tests
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def eval_args(tiny_model_dir):
    def make(out, *extra) -> list[str]:
        return ["eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", ",".join(TASKS),
                "--limit", "2", "--target-tokens", "300", "--methods", "full,snapkv,pyramidkv,streamingllm",
                "--budget", "32,64", "--batch-size", "4", "--out", str(out), *map(str, extra)]

    return make


def run_main(argv: list[str]) -> int:
    from ripplekv.cli import app as cli

    old = sys.argv
    sys.argv = ["ripplekv", *argv]
    try:
        cli.main()
    except SystemExit as stop:
        return stop.code
    finally:
        sys.argv = old
    return 0


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, eval_args) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    assert run_main(eval_args(out)) == 0
    return out


def sorted_lines(run: Path) -> list[str]:
    return sorted(without_peak_memory((run / "predictions.jsonl").read_text(encoding="utf-8")).splitlines())


def test_two_workers_write_the_same_predictions_as_one_process(one_process, eval_args, tmp_path, ray_cluster, run_cli):
    code, _, err = run_cli(*eval_args(tmp_path / "run", "--workers", 2))
    assert code == 0, err
    assert sorted_lines(tmp_path / "run") == sorted_lines(one_process)
    assert len(sorted_lines(one_process)) == len(TASKS) * 2 * (1 + 3 * 2)
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == json.loads(
        (one_process / "config.json").read_text())  # the worker count is not part of a run's identity


def test_a_worker_killed_mid_run_loses_and_repeats_nothing(one_process, eval_args, tmp_path, ray_cluster, run_cli,
                                                           monkeypatch):
    """The worker running the third sample kills its own process the first time; the sample runs again."""
    marker = tmp_path / "killed.pid"
    victim = json.loads((one_process / "config.json").read_text())["samples"][TASKS[1]][0]
    original = evaluate.sample_rows

    def dies_once(settings, methods, budgets, loaded, job, progress=None):  # pickled by value into the workers
        if job.sid == victim and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        return original(settings, methods, budgets, loaded, job, progress)

    monkeypatch.setattr(evaluate, "sample_rows", dies_once)
    code, _, err = run_cli(*eval_args(tmp_path / "run", "--workers", 2))
    assert code == 0, err
    assert marker.exists() and not psutil.pid_exists(int(marker.read_text())), "no worker died mid-run"
    assert f"a worker died on {TASKS[1]}/{victim}" in " ".join(err.split())
    rows = [json.loads(line) for line in sorted_lines(tmp_path / "run")]
    keys = [(r["task"], r["id"], r["method"], r["budget"]) for r in rows]
    assert len(keys) == len(set(keys))  # nothing written twice
    assert sorted_lines(tmp_path / "run") == sorted_lines(one_process)  # nothing lost


@pytest.mark.slow
def test_profile_with_two_workers_equals_one_process(tiny_model_dir, tmp_path, ray_cluster, run_cli):
    args = ["profile", "--model", tiny_model_dir, "--calib-samples", 3, "--seeds", 2, "--eta", 1.0,
            "--target-tokens", 300]
    assert run_cli(*args, "--out", tmp_path / "one")[0] == 0
    code, _, err = run_cli(*args, "--out", tmp_path / "two", "--workers", 2)
    assert code == 0, err
    for name in ("per_sample.csv", "sensitivity.csv"):
        assert (tmp_path / "two" / name).read_text() == (tmp_path / "one" / name).read_text(), name


def waits_for_the_rest(folder: Path, unit: int) -> int:
    """Unit 0 finishes only once every other unit has (or after 120 s): a striped schedule would stall on it."""
    if unit:
        (folder / str(unit)).touch()
    deadline = time.monotonic() + 120
    while unit == 0 and len(list(folder.iterdir())) < 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    return unit * unit


def test_units_are_pulled_so_a_long_unit_does_not_hold_back_the_rest(ray_cluster, tmp_path):
    finished = list(distributed.run_units(list(range(8)), lambda: tmp_path, waits_for_the_rest,
                                          distributed.Workers(2, threads=1)))
    assert sorted(finished) == [(unit, unit * unit) for unit in range(8)]
    assert [unit for unit, _ in finished][-1] == 0  # the other worker took every other unit meanwhile


def fails_to_load():
    raise UserError("model directory /nowhere has no config.json")


def test_a_worker_error_ends_the_run_with_its_own_line(ray_cluster):
    with pytest.raises(UserError, match="^model directory /nowhere has no config.json$"):
        list(distributed.run_units([1, 2], fails_to_load, waits_for_the_rest, distributed.Workers(2, threads=1)))


def test_without_ray_workers_say_how_to_install_it(eval_args, tmp_path, monkeypatch, run_cli):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    code, _, err = run_cli(*eval_args(tmp_path / "run", "--workers", 2))
    assert code == 2
    assert err.strip().splitlines() == [
        "error: --workers and --ray-address need Ray, which is not installed: pip install 'ripplekv[ray]' "
        "(or `make install`)"]
    assert not (tmp_path / "run").exists()


def test_zero_workers_is_one_line(eval_args, tmp_path, run_cli):
    code, _, err = run_cli(*eval_args(tmp_path / "run", "--workers", 0))
    assert (code, err.strip()) == (2, "error: --workers must be at least 1, got 0")


def test_an_unreachable_cluster_is_one_line_before_any_work(eval_args, tmp_path, run_cli):
    code, _, err = run_cli(*eval_args(tmp_path / "run", "--ray-address", "127.0.0.1:1"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: no Ray cluster answers at 127.0.0.1:1") and "ray start --head" in err
    assert not (tmp_path / "run").exists()


def _serve(handler_class):
    """A loopback server in a thread: (port, stop)."""
    import socketserver
    import threading

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler_class)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1], lambda: (server.shutdown(), server.server_close())


def test_a_web_server_is_not_a_cluster_one_line_before_ray_connects(eval_args, tmp_path, run_cli, monkeypatch):
    """An HTTP server on the port: Ray would retry its GCS connection for minutes; the probe says so at once."""
    from http.server import SimpleHTTPRequestHandler

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):  # the server's own log would land on the stderr checked here
            pass

    import ray

    joined = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: joined.append(kwargs))
    port, stop = _serve(Quiet)
    try:
        code, _, err = run_cli(*eval_args(tmp_path / "run", "--workers", 2, "--ray-address", f"127.0.0.1:{port}"))
    finally:
        stop()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: 127.0.0.1:{port} is not a Ray cluster (it answers, but not as Ray")
    assert "ray start --head" in err
    assert joined == []  # refused by the probe, before Ray's own connection (which retries for minutes)
    assert not (tmp_path / "run").exists()


def test_a_silent_listener_is_not_a_cluster_after_the_timeout():
    import socketserver

    class Silent(socketserver.BaseRequestHandler):
        def handle(self):
            time.sleep(3)

    port, stop = _serve(Silent)
    try:
        with pytest.raises(UserError, match=r"is not a Ray cluster \(nothing answered within 0.5 s\)"):
            distributed.check_reachable(f"127.0.0.1:{port}", timeout=0.5)
    finally:
        stop()


def test_the_probe_lets_a_real_cluster_through(ray_cluster):
    """Ray's GCS is a gRPC server: it answers the probe's HTTP/2 opening with its SETTINGS frame."""
    distributed.check_reachable(ray_cluster.get_runtime_context().gcs_address)
