"""Run storage on a real S3-compatible server (the moto server on loopback, ``tests/support/s3_server.py``)
and on local paths: the same reads, writes and transfers on both; checkpoints that appear whole
or not at all (``meta.json`` last, ``latest`` after it), even when the endpoint dies mid-upload;
a copy that does not match its ``meta.json`` is refused; working copies that mirror growing
files; and the settings that are refused before anything runs.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from support.s3_server import CREDENTIALS, Relay, S3Server

from rlvla3.checkpoint.files import (
    CheckpointMeta,
    StateSnapshot,
    check_init_from,
    check_resume,
    load_optimizer_state,
    load_policy,
    load_rng_state,
    read_meta,
    save_run_checkpoint,
)
from rlvla3.checkpoint.storage import SCRATCH_ENV, Mirror, Storage, check_reach, join
from rlvla3.checkpoint.trust import (
    CheckpointError,
    listed_files,
    locate_checkpoint,
    resolve_checkpoint,
)
from rlvla3.config import ConfigError, Named
from rlvla3.policies import build_policy
from rlvla3.run_config import load_run_config
from rlvla3.types import EnvSpec

SPEC = EnvSpec(cameras=("cam",), image_size=(16, 16), state_dim=3, action_dim=2, chunk_len=1,
               max_decisions=10, num_tasks=1, num_init_states=4)
SMALL = Named("small", {"channels": 4, "hidden": 16})


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The moto server, with the credentials of the environment set for this process."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in CREDENTIALS.items():
            env.setenv(key, value)
        server = S3Server(tmp_path_factory.mktemp("s3"))
        server.create_bucket("runs")
        yield server
        server.stop()


@pytest.fixture(params=["path", "bucket"])
def where(request, tmp_path):
    """A fresh directory: a local path, or a prefix in the bucket."""
    if request.param == "path":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3").uri("runs", f"files-{time.time_ns()}")


def test_storage_reads_writes_lists_and_moves_files_alike_on_a_path_and_in_a_bucket(
        where, tmp_path):
    store = Storage(where)
    store.write_text("a/b.txt", "first")
    store.write_text("a/b.txt", "second")  # whole files: the old or the new, never a part
    assert store.read_text("a/b.txt") == "second" and store.is_file("a/b.txt")
    assert store.exists("a") and not store.is_file("a") and not store.exists("nope")
    payload = torch.randn(300_000).numpy().tobytes()
    (tmp_path / "blob").write_bytes(payload)
    sent = store.upload(tmp_path / "blob", "a/blob")
    got = store.download("a/blob", tmp_path / "copy")
    assert sent == got and sent.size == len(payload)
    assert (tmp_path / "copy").read_bytes() == payload
    assert store.read_range("a/blob", 10, 5) == payload[10:15]
    assert store.sizes() == {"a/b.txt": 6, "a/blob": len(payload)}
    assert store.listdir() == ["a"] and store.listdir("a") == ["b.txt", "blob"]
    with pytest.raises(FileNotFoundError, match="nope"):
        store.read_text("nope")
    store.delete("a")
    assert store.sizes() == {}


def _weights(seed: int, n: int = 1000) -> StateSnapshot:
    torch.manual_seed(seed)
    return StateSnapshot({"w": torch.randn(n), "b": torch.randn(3)})


def test_a_checkpoint_in_a_bucket_lists_its_files_and_loads_on_another_node(s3, tmp_path,
                                                                           monkeypatch):
    run = s3.uri("runs", "ckpt-run")
    policy = build_policy(SMALL, SPEC)
    optimizer = torch.optim.Adam(policy.parameters())
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "writer"))
    for version in (1, 2, 3):
        path = save_run_checkpoint(run, policy, CheckpointMeta(SMALL, SPEC, version), optimizer,
                                   rng=torch.get_rng_state())
    root = Storage(join(run, "checkpoints"))
    assert root.read_text("latest") == "step-00000003\n"
    assert sorted(root.listdir()) == ["latest", "step-00000002", "step-00000003"]  # pruned
    assert path == locate_checkpoint(run) == join(run, "checkpoints", "step-00000003")
    files = listed_files(run)
    assert set(files) == {"policy.safetensors", "optimizer.pt", "rng.safetensors"}
    sizes = Storage(path).sizes()
    assert all(sizes[name] == f["size"] for name, f in files.items())
    # another node: nothing of the writer's scratch, everything from the bucket
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "reader"))
    loaded, meta = load_policy(run)
    assert meta.version == 3 and read_meta(run).policy == SMALL
    for key, value in policy.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    assert load_optimizer_state(run)["param_groups"][0]["lr"] == optimizer.defaults["lr"]
    assert load_rng_state(run).dtype == torch.uint8
    local = resolve_checkpoint(run)
    assert str(local).startswith(str(tmp_path / "reader"))
    assert not (tmp_path / "writer" / "staging").exists() or not any(
        (tmp_path / "writer" / "staging").iterdir())  # the staged upload was cleaned up


def test_a_copy_that_does_not_match_its_meta_json_is_refused(s3, tmp_path, monkeypatch):
    run = s3.uri("runs", "tampered")
    save_run_checkpoint(run, _weights(0), CheckpointMeta(SMALL, SPEC, 1))
    ckpt = Storage(locate_checkpoint(run))
    original = ckpt.read_bytes("policy.safetensors")
    ckpt.write_bytes("policy.safetensors", original[:-4] + b"\0\0\0\0")  # same size
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "a"))
    with pytest.raises(CheckpointError, match="does not match meta.json"):
        resolve_checkpoint(run)
    ckpt.delete("policy.safetensors")
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "b"))
    with pytest.raises(CheckpointError, match=r"policy.safetensors \(the policy's weights\) "
                                              "is missing; meta.json lists it"):
        resolve_checkpoint(run)
    local = tmp_path / "local-run"
    save_run_checkpoint(local, _weights(0), CheckpointMeta(SMALL, SPEC, 1))
    (local / "checkpoints" / "step-00000001" / "policy.safetensors").write_bytes(b"short")
    with pytest.raises(CheckpointError, match="holds 5 bytes"):
        resolve_checkpoint(local)


def test_a_checkpoint_without_its_optimizer_state_serves_everything_but_resuming(
        where, tmp_path, monkeypatch):
    """A copy of a checkpoint without the optimizer and RNG state its ``meta.json`` lists (as
    the repository keeps results): evaluating, exporting and ``init_from`` load its weights;
    resuming is refused before anything starts, in one line naming the file and what it is
    for, and so is reading that state."""
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "scratch"))
    policy = build_policy(SMALL, SPEC)
    ckpt = save_run_checkpoint(where, policy, CheckpointMeta(SMALL, SPEC, 4),
                               torch.optim.Adam(policy.parameters()), rng=torch.get_rng_state())
    for name in ("optimizer.pt", "rng.safetensors"):
        Storage(ckpt).delete(name)
    loaded, _ = load_policy(where)
    for key, value in policy.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    assert check_init_from(where, SMALL, SPEC, build_policy(SMALL, SPEC)) == ckpt
    with pytest.raises(ConfigError) as err:
        check_resume(where)
    line = str(err.value)
    assert "\n" not in line and "None" not in line, line
    assert line.startswith("config field '--resume': ") and line.endswith(
        "optimizer.pt (the optimizer state, which only --resume needs) is missing; meta.json "
        f"lists it ({listed_files(where)['optimizer.pt']['size']} bytes)"), line
    with pytest.raises(CheckpointError, match=r"optimizer.pt \(the optimizer state"):
        load_optimizer_state(where)
    with pytest.raises(CheckpointError, match=r"rng.safetensors \(the learner's RNG state"):
        load_rng_state(where)


def test_an_endpoint_killed_mid_upload_leaves_latest_on_the_previous_checkpoint(s3, tmp_path):
    """The run talks to S3 through a relay (its endpoint); the relay is SIGKILLed while the
    second checkpoint uploads. The save fails, ``latest`` still names the first checkpoint,
    which loads; the torn directory has no ``meta.json``, and the next save prunes it."""
    relay = Relay(s3.port, rate_mb_s=25.0)
    run = s3.uri("runs", "torn", port=relay.port)
    direct = s3.uri("runs", "torn")  # the bucket as the server holds it
    save_run_checkpoint(run, _weights(1), CheckpointMeta(SMALL, SPEC, 1))
    big = _weights(2, n=3_000_000)  # 12 MB of weights
    optimizer = StateSnapshot({"state": {0: {"exp_avg": torch.randn(6_000_000)}},
                               "param_groups": []})  # 24 MB: about a second through the relay
    result: dict = {}

    def save() -> None:
        try:
            result["path"] = save_run_checkpoint(run, big, CheckpointMeta(SMALL, SPEC, 2),
                                                 optimizer)
        except OSError as exc:
            result["error"] = exc

    thread = threading.Thread(target=save)
    thread.start()
    torn = Storage(join(direct, "checkpoints", "step-00000002"))
    deadline = time.monotonic() + 60
    while not torn.is_file("policy.safetensors"):  # the first file is in: kill mid-checkpoint
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.01)
    relay.kill()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the save hung after its endpoint died"
    assert "error" in result, result  # it failed, and said so
    assert Storage(join(direct, "checkpoints")).read_text("latest") == "step-00000001\n"
    assert not torn.is_file("meta.json") and not torn.is_file("optimizer.pt")
    assert locate_checkpoint(direct) == join(direct, "checkpoints", "step-00000001")
    weights = load_file(str(resolve_checkpoint(direct) / "policy.safetensors"))
    torch.testing.assert_close(weights["w"], _weights(1).state["w"])
    # the endpoint is back: the next save lands and the torn directory goes
    save_run_checkpoint(direct, _weights(3), CheckpointMeta(SMALL, SPEC, 3))
    assert Storage(join(direct, "checkpoints")).listdir() == [
        "latest", "step-00000001", "step-00000003"]


def test_a_mirror_keeps_growing_files_in_storage_and_a_resume_appends_to_them(s3):
    uri = s3.uri("runs", "mirror-run")
    first = Mirror(uri, every_s=3600.0)
    assert first.remote and first.local.is_dir()
    with open(first.local / "metrics.jsonl", "a") as f:
        f.write('{"step": 1}\n')
    (first.local / "tb").mkdir()
    (first.local / "tb" / "events.1").write_bytes(b"e1")
    assert first.push("metrics.jsonl", "tb") == 2
    assert first.push("metrics.jsonl", "tb") == 0  # nothing changed
    with open(first.local / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\n')
    assert first.sync("metrics.jsonl") == 0  # not yet: every_s
    first.close()
    assert not first.local.exists()
    second = Mirror(uri, keep=("metrics.jsonl", "absent.json"))  # a resumed run
    assert (second.local / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert first.local != second.local  # each its own working copy
    with open(second.local / "metrics.jsonl", "a") as f:
        f.write('{"step": 3}\n')
    second.write_text("summary.json", "{}")
    second.push()
    assert Storage(uri).sizes() == {"metrics.jsonl": 24, "tb/events.1": 2, "summary.json": 2}
    second.close()


def test_a_local_mirror_is_the_directory_itself(tmp_path):
    files = Mirror(tmp_path / "run")
    assert files.local == tmp_path / "run" and not files.remote
    files.write_text("config.yaml", "a: 1\n")
    assert files.push() == 0 and (tmp_path / "run" / "config.yaml").read_text() == "a: 1\n"
    files.close()
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_settings_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="storage.root.*credential.*secret_key"):
        load_run_config("smoke", overrides=["storage.root=s3://b/runs?secret_key=abc"])
    with pytest.raises(ConfigError, match="storage.root.*credential"):
        load_run_config("smoke", overrides=["storage.root=s3://user:pw@b/runs"])
    with pytest.raises(ConfigError, match="credential") as told:
        Storage("s3://b/runs/x?endpoint_override=h:9000&secret_key=hunter2")  # e.g. --resume
    assert "hunter2" not in str(told.value)
    assert load_run_config("smoke", overrides=["run_root=elsewhere"]).storage.root == "elsewhere"
    with pytest.raises(ConfigError) as refused:
        check_reach("/data/runs/x", shared=False, nodes=2, can_grow=False, field="storage.root")
    assert refused.value.field == "storage.root"
    assert "storage.shared=true" in str(refused.value) and "2 nodes" in str(refused.value)
    with pytest.raises(ConfigError, match="an autoscaler"):
        check_reach("runs/x", shared=False, nodes=1, can_grow=True, field="storage.root")
    check_reach("/nfs/runs/x", shared=True, nodes=8, can_grow=True, field="storage.root")
    check_reach("s3://bucket/runs/x", shared=False, nodes=8, can_grow=True, field="storage.root")
    check_reach("runs/x", shared=False, nodes=1, can_grow=False, field="storage.root")


def test_a_job_writing_to_a_bucket_that_does_not_exist_stops_before_ray_with_one_line(
        s3, tmp_path, capsys):
    """``rl --storage``, ``sft --run-dir``, ``eval --output-dir`` and ``datalake record
    --output-dir`` in a bucket that does not exist: one line naming the field and the missing
    bucket, exit status 2, before Ray starts (this test process refuses ``ray.init``)."""
    from importlib.util import find_spec

    from commands.datalake import main as datalake_main
    from commands.rl import main as rl_main
    from commands.sft import main as sft_main
    from datalake import synthetic
    from datalake.writer import WriterConfig, write_dataset

    data = tmp_path / "ds"
    write_dataset(data, synthetic.episodes(2, 6, 8, size=(16, 16)), WriterConfig(codec="av1"))
    missing = s3.uri("no-such-bucket", "x")
    runs = [(rl_main, ["--preset", "smoke", "--storage", missing, "--set", "name=a"],
             "rlvla3 rl: invalid config: config field 'storage.root': cannot write to"),
            (sft_main, ["--dataset", str(data), "--run-dir", missing],
             "rlvla3 sft: config field 'run_dir': cannot write to")]
    if find_spec("libero") is not None:  # both need the simulator's extra before the bucket
        from commands.eval import main as eval_main

        runs += [(eval_main, ["--policy", "random", "--episodes", "0:0", "--output-dir",
                              missing], "rlvla3 eval: config field '--output-dir': cannot "
                                        "write to"),
                 (datalake_main, ["record", "--episodes", "1", "--output-dir", missing],
                  "rlvla3 datalake record: config field '--output-dir': cannot write to")]
    for main, argv, start in runs:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
        assert "NO_SUCH_BUCKET" in err[0] and "Traceback" not in err[0]


@pytest.mark.slow
def test_sft_keeps_its_run_in_a_bucket_and_resumes_from_it(s3, tmp_path):
    """``rlvla3 sft`` with its dataset and its run directory in the bucket: checkpoints,
    config, metrics and Ray Train's own files land there; a second run with a larger budget
    resumes from the bucket's checkpoint."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from datalake import synthetic
    from datalake.writer import WriterConfig, write_dataset

    data = s3.uri("runs", "sft-data")
    write_dataset(data, synthetic.episodes(4, 20, 30, size=(32, 32)),
                  WriterConfig(codec="h264", episodes_per_file=2))
    run = s3.uri("runs", "sft-run")
    options = ["lake.image_size=[32, 32]", "lake.chunk_len=4", "lake.decode_actors=1",
               "lake.max_tokens=600", "lake.shuffle_buffer=32", "lake.pack_window=32",
               "policy.options={channels: 8, hidden: 64}", "log_every=4", "checkpoint_every=4"]
    env = {**os.environ, **s3.env, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "RLVLA3_SCRATCH": str(tmp_path / "scratch")}

    def sft(steps: int, where: str) -> dict:
        argv = ["--dataset", data, "--policy", "small", where, run, "--workers", "1",
                "--max-steps", str(steps), *sum((["--set", o] for o in options), [])]
        proc = subprocess.run([sys.executable, "-m", "rlvla3", "sft", *argv], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout[proc.stdout.index("{"):])

    first = sft(8, "--run-dir")
    assert first["run_dir"] == run and first["steps"] == 8
    assert first["checkpoint"] == join(run, "checkpoints", "step-00000008")
    second = sft(12, "--resume")
    assert read_meta(run).version == 12 and second["steps"] == 12
    rows = [json.loads(x) for x in Storage(run).read_text("metrics.jsonl").splitlines()]
    assert [r["step"] for r in rows] == [4, 8, 12]  # one history over both runs
    files = Storage(run).sizes()
    assert {"config.yaml", "metrics.jsonl", "checkpoints/latest"} <= set(files)
    assert any(name.startswith("ray/") for name in files)  # Ray Train's storage_path
    assert not (tmp_path / "runs").exists()


def test_a_snapshot_copies_into_the_previous_ones_buffers():
    """The learner's pause per checkpoint: from the second save on, weights and optimizer
    state are copied into the previous copy's memory (no new allocation), and each copy holds
    the values of its own moment."""
    from rlvla3.checkpoint.files import snapshot

    policy = build_policy(SMALL, SPEC)
    optimizer = torch.optim.Adam(policy.parameters())
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    first = snapshot(policy, optimizer)
    kept = {k: v.clone() for k, v in first[0].state.items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    optimizer.step()
    second = snapshot(policy, optimizer, reuse=(first[0], first[1]))
    name = next(iter(kept))
    assert second[0].state[name].data_ptr() == first[0].state[name].data_ptr()  # reused
    torch.testing.assert_close(second[0].state[name], policy.state_dict()[name])
    assert not torch.equal(second[0].state[name], kept[name])
    live = optimizer.state_dict()["state"][0]["exp_avg"]
    copied = second[1].state["state"][0]["exp_avg"]
    assert copied.data_ptr() == first[1].state["state"][0]["exp_avg"].data_ptr()
    assert copied.data_ptr() != live.data_ptr()
    torch.testing.assert_close(copied, live)
