"""Units rendered for a config and a GPU layout, checked by `systemd-analyze verify`, and their worker command
run for real as systemd would run it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from dflash_queue.lanes.tensor_parallel import vllm_tensor_parallel
from dflash_queue.ops.systemd import (
    InstallSettings,
    UnitLayout,
    detect_systemd_version,
    install_units,
    render_units,
)
from dflash_queue.queue.app import configure_app
from dfq_testing.gpus import fake_nvidia_smi

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
LAYOUT = UnitLayout({"generate": ((0, 1), (2,)), "extract": ((3,),)})


def settings(tmp_path: Path, config, **overrides) -> InstallSettings:
    values = dict(
        config_path=Path(config.source),
        env_file=tmp_path / "etc" / "dflash.env",
        systemd_version=detect_systemd_version(),
    )
    values.update(overrides)
    return InstallSettings(**values)


def install(config, layout: UnitLayout, settings: InstallSettings, dest: Path, **options):
    """install_units with the config's sections, as `dflash-queue systemd` calls it."""
    return install_units(
        config.run, config.broker, config.storage, layout, settings, dest,
        tensor_parallel=vllm_tensor_parallel(config.generate, config.extract), **options,
    )


def verify(unit_dir: Path, *units: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *(str(unit_dir / unit) for unit in units)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def directive(text: str, key: str) -> list[str]:
    return re.findall(rf"^{key}=(.*)$", text, flags=re.M)


@needs_systemd_analyze
def test_installed_units_pass_systemd_analyze_verify(make_config, tmp_path):
    config = make_config()
    dest = tmp_path / "units"
    report = install(config, LAYOUT, settings(tmp_path, config), dest, node_gpus=(0, 1, 2, 3))
    assert sorted(p.name for p in report.written) == [
        "dflash-extract@.service",
        "dflash-flower.service",
        "dflash-generate@.service",
        "dflash.target",
    ]
    # Instances are verified as systemd would load them: the instance name names the GPUs.
    instances = report.instances
    assert instances == [
        "dflash-generate@0-1.service",
        "dflash-generate@2.service",
        "dflash-extract@3.service",
        "dflash-flower.service",
    ]
    result = verify(
        dest, "dflash-generate@0-1.service", "dflash-extract@3.service", "dflash-flower.service", "dflash.target"
    )
    assert result.returncode == 0, result.stderr
    assert "Unknown key" not in result.stderr and "Failed" not in result.stderr, result.stderr

    generate = (dest / "dflash-generate@.service").read_text()
    assert directive(generate, "KillMode") == ["mixed"]
    assert directive(generate, "KillSignal") == ["SIGTERM"]
    assert int(directive(generate, "TimeoutStopSec")[0]) > config.broker.task_timeout_s
    assert directive(generate, "Restart") == ["on-failure"]
    assert directive(generate, "StandardOutput") == ["journal"]
    assert directive(generate, "EnvironmentFile") == [str(tmp_path / "etc" / "dflash.env")]
    exec_start = directive(generate, "ExecStart")[0]
    assert "--gpus %i --hostname generate-%i@%%h" in exec_start
    assert f"-c {Path(config.source).resolve()}" in exec_start
    target = (dest / "dflash.target").read_text()
    assert directive(target, "Wants") == [" ".join(instances)]


@needs_systemd_analyze
def test_verify_catches_a_missing_executable(make_config, tmp_path):
    """The verification has teeth: a unit pointing at a binary that does not exist fails it."""
    config = make_config()
    dest = tmp_path / "units"
    install(config, LAYOUT, settings(tmp_path, config, exec_command="/nonexistent/bin/dflash-queue"), dest)
    result = verify(dest, "dflash-flower.service")
    assert result.returncode != 0
    assert "/nonexistent/bin/dflash-queue" in result.stderr


def test_a_worker_stopped_for_failing_checks_is_not_restarted_and_one_whose_engine_died_is(make_config, tmp_path):
    from dflash_queue.queue.worker import EXIT_ENGINE_LOST
    from dflash_queue.runstate.stopped_workers import EXIT_FAILING_CHECKS

    config = make_config()
    units = render_units(config.run, config.broker, LAYOUT, settings(tmp_path, config))
    for unit in ("dflash-generate@.service", "dflash-extract@.service"):
        assert directive(units[unit], "Restart") == ["on-failure"]
        assert directive(units[unit], "RestartPreventExitStatus") == [str(EXIT_FAILING_CHECKS)]
    assert EXIT_ENGINE_LOST != EXIT_FAILING_CHECKS
    assert "RestartPreventExitStatus" not in units["dflash-flower.service"]


def test_backoff_keys_only_for_a_systemd_that_knows_them(make_config, tmp_path):
    config = make_config()
    old = render_units(config.run, config.broker, LAYOUT, settings(tmp_path, config, systemd_version=252))
    new = render_units(config.run, config.broker, LAYOUT, settings(tmp_path, config, systemd_version=254))
    assert "RestartSteps" not in old["dflash-generate@.service"]
    assert directive(new["dflash-generate@.service"], "RestartSteps") == ["5"]
    assert directive(new["dflash-generate@.service"], "RestartMaxDelaySec") == ["600"]
    for text in (*old.values(), *new.values()):
        assert "@" not in "".join(re.findall(r"@[A-Z_]+@", text))  # no placeholder left


def test_layout_errors_and_warnings(make_config, tmp_path):
    with pytest.raises(ValueError, match="GPU 1 is in two generate groups"):
        UnitLayout({"generate": ((0, 1), (1,))}).check()
    with pytest.raises(ValueError, match="GPU 4 is not one of this node's GPUs"):
        UnitLayout({"extract": ((4,),)}).check((0, 1, 2, 3))
    with pytest.raises(ValueError, match="no workers: give --generate and/or --extract and/or --audit GPU groups"):
        UnitLayout().check()
    with pytest.raises(ValueError, match=r"unknown lane\(s\) \['verify'\]"):
        UnitLayout({"verify": ((0,),)}).check()
    # The reference audit's workers: a spare GPU of the node (or cores beside an extract worker's GPU).
    assert UnitLayout({"extract": ((0,),), "audit": ((1,),)}).check() == []
    assert UnitLayout({"audit": ((7,),)}).instances() == ["dflash-audit@7.service", "dflash-flower.service"]
    assert UnitLayout({"extract": ((0,), (1,)), "generate": ((0,), (2,))}).check() == [
        "GPUs [0] run workers of several lanes (generate, extract): every engine must fit in memory"
    ]


def test_a_vllm_lanes_groups_must_match_its_tensor_parallel_size(make_config, tmp_path):
    sizes = {"generate": 2, "extract": 4}
    assert UnitLayout({"generate": ((0, 1), (2, 3)), "extract": ((4, 5, 6, 7),)}).check(tensor_parallel=sizes) == []
    with pytest.raises(ValueError, match=r"^--generate: generate GPU group 2 has 1 GPU\(s\) but "
                                         r"generate.vllm.tensor_parallel_size is 2"):
        UnitLayout({"generate": ((0, 1), (2,))}).check(tensor_parallel=sizes)
    with pytest.raises(ValueError, match=r"extract GPU group 4,5 has 2 GPU\(s\) but extract.vllm.tensor_parallel_size is 4"):
        UnitLayout({"extract": ((4, 5),)}).check(tensor_parallel=sizes)
    # The Transformers extract engine spreads its layers over a group of any size.
    assert UnitLayout({"extract": ((0, 1, 2), (3,))}).check(tensor_parallel={"generate": 2}) == []
    # Instance names read back as the same groups: ranges, and GPUs that are not one range joined by "_".
    assert UnitLayout({"extract": ((0, 2), (4, 5, 6, 7))}).instances() == [
        "dflash-extract@0_2.service", "dflash-extract@4-7.service", "dflash-flower.service"
    ]

    from click.testing import CliRunner

    from dflash_queue.cli import main

    config = make_config(extract={"engine": "vllm"}, **{"extract.vllm": {"tensor_parallel_size": 2}})
    install = ["systemd", "install", "-c", config.source, "--no-flower", "--dest", str(tmp_path / "units"),
               "--env-file", str(tmp_path / "dflash.env")]
    refused = CliRunner().invoke(main, [*install, "--extract", "0-1,2"])
    assert refused.exit_code == 1 and not (tmp_path / "units").exists()
    assert "--extract: extract GPU group 2 has 1 GPU(s) but extract.vllm.tensor_parallel_size is 2" in refused.output
    assert CliRunner().invoke(main, [*install, "--extract", "0-1,2-3", "--generate", "4"]).exit_code == 0
    # 0-3 is GPUs 0 to 3: a group of four where the engine spans two.
    refused = CliRunner().invoke(main, [*install, "--extract", "0-3"])
    assert "extract GPU group 0,1,2,3 has 4 GPU(s) but extract.vllm.tensor_parallel_size is 2" in refused.output


def test_env_file_is_private_and_kept_unless_forced(make_config, tmp_path):
    config = make_config()
    s = settings(tmp_path, config)
    install(config, LAYOUT, s, tmp_path / "units")
    text = s.env_file.read_text()
    assert stat.S_IMODE(s.env_file.stat().st_mode) == 0o600
    assert f"DFQ_BROKER_URL={config.broker.url}" in text
    assert f"DFQ_STORAGE_URL={config.storage.url}" in text
    assert re.search(r"^FLOWER_BASIC_AUTH=admin:\S{16,}$", text, flags=re.M)
    assert "#AWS_SECRET_ACCESS_KEY=" in text
    assert "#DFQ_BROKER_PASSWORD=" in text and "#DFQ_BROKER_PASSWORD_FILE=" in text

    s.env_file.write_text("FLOWER_BASIC_AUTH=ops:mine\n")
    report = install(config, LAYOUT, s, tmp_path / "units")
    assert report.env_file_kept and s.env_file.read_text() == "FLOWER_BASIC_AUTH=ops:mine\n"
    install(config, LAYOUT, s, tmp_path / "units", force_env=True)
    assert "DFQ_BROKER_URL" in s.env_file.read_text()


def systemd_command(unit_text: str, instance: str) -> list[str]:
    """ExecStart as systemd runs it for an instance: %i is the instance, %% a literal %."""
    line = directive(unit_text, "ExecStart")[0]

    def expand(match: re.Match) -> str:
        specifier = match.group(1)
        assert specifier in "i%", f"unexpected systemd specifier %{specifier} in {line}"
        return instance if specifier == "i" else "%"

    return shlex.split(re.sub(r"%(.)", expand, line))


def environment(unit_text: str, env_file: Path) -> dict[str, str]:
    """The unit's Environment= lines plus its EnvironmentFile, as systemd would pass them."""
    env = {k: v for line in directive(unit_text, "Environment") for k, _, v in [line.strip('"').partition("=")]}
    for line in env_file.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


@pytest.mark.slow
def test_generate_unit_command_starts_a_worker_named_for_its_gpus(make_config, tmp_path):
    """Run the rendered ExecStart for instance 0-1: a real worker, node name generate-0-1@<host>."""
    config = make_config()
    s = settings(tmp_path, config)
    report = install(config, LAYOUT, s, tmp_path / "units")
    unit = (tmp_path / "units" / "dflash-generate@.service").read_text()
    command = systemd_command(unit, "0-1")
    env = {**os.environ, **environment(unit, s.env_file)}
    # A node with two GPUs (this machine has none): `--gpus 0-1` is checked against its listing.
    env["PATH"] = f"{fake_nvidia_smi(tmp_path / 'bin', 2)}{os.pathsep}{env['PATH']}"
    log = open(tmp_path / "worker.log", "wb")
    workdir = directive(unit, "WorkingDirectory")[0]
    worker = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    node = f"generate-0-1@{socket.gethostname()}"
    app = configure_app(config)
    try:
        replies = []
        with app.connection_for_read() as connection:  # not the pool's: see queue/launcher.py wait_ready
            for _ in range(600):
                assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                replies = app.control.ping(destination=[node], timeout=0.5, connection=connection)
                if replies:
                    break
            assert replies == [{node: {"ok": "pong"}}]
            queues = app.control.inspect(destination=[node], timeout=5, connection=connection).active_queues()
        assert [q["name"] for q in queues[node]] == ["generate"]
    finally:
        worker.terminate()  # what systemd's KillMode=mixed sends first: a warm shutdown
        code = worker.wait(timeout=60)
        log.close()
    assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert report.written


def test_the_install_command_takes_one_gpu_group_option_per_lane(make_config, tmp_path):
    from click.testing import CliRunner

    from dflash_queue.cli import main

    config = make_config()
    dest = tmp_path / "units"
    result = CliRunner().invoke(main, [
        "systemd", "install", "-c", config.source, "--generate", "0-1", "--extract", "2,3", "--no-flower",
        "--dest", str(dest), "--env-file", str(tmp_path / "dflash.env"), "--systemd-version", "254",
    ])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dest.iterdir()) == ["dflash-extract@.service", "dflash-generate@.service",
                                                      "dflash.target"]
    for lane in ("generate", "extract"):  # one template, rendered per lane
        unit = (dest / f"dflash-{lane}@.service").read_text()
        [exec_start] = directive(unit, "ExecStart")
        assert exec_start.endswith(f"worker {lane} -c {config.source} --gpus %i --hostname {lane}-%i@%%h")
        assert directive(unit, "SyslogIdentifier") == [f"dflash-{lane}-%i"] and "@LANE@" not in unit
    wants = directive((dest / "dflash.target").read_text(), "Wants")
    assert wants == ["dflash-generate@0-1.service dflash-extract@2.service dflash-extract@3.service"]
    bad = CliRunner().invoke(main, ["systemd", "install", "-c", config.source, "--extract", "x", "--dest", str(dest)])
    assert bad.exit_code == 2 and "--extract" in bad.output


def test_install_under_a_root_touches_nothing_outside_it_and_prints_every_path(make_config, tmp_path):
    from click.testing import CliRunner

    from dflash_queue.cli import main

    state_dir = tmp_path / "system" / "var" / "lib" / "dflash-queue" / "job"  # where the config says, outside root
    config = make_config(run={"name": "job", "state_dir": str(state_dir)})
    root = tmp_path / "root"
    result = CliRunner().invoke(main, [
        "systemd", "install", "-c", config.source, "--generate", "0", "--extract", "1", "--no-flower",
        "--root", str(root), "--systemd-version", "254",
    ])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "system").exists()  # the config's state directory is not created outside the root
    rooted_state = root / state_dir.relative_to("/")
    assert rooted_state.is_dir() and f"created directory {rooted_state}" in result.output
    units = root / "etc" / "systemd" / "system"
    assert f"wrote {units / 'dflash.target'}" in result.output
    assert f"wrote {root / 'etc' / 'dflash-queue' / 'dflash.env'} (mode 0600)" in result.output
    created = {Path(line.removeprefix("created directory ")) for line in result.output.splitlines()
               if line.startswith("created directory ")}
    assert all(path.is_relative_to(root) for path in created) and units in created
    unit = (units / "dflash-generate@.service").read_text()
    assert directive(unit, "WorkingDirectory") == [str(state_dir)]  # the installed system's paths
    assert directive(unit, "EnvironmentFile") == ["/etc/dflash-queue/dflash.env"]
