"""Lifecycle policy, config parsing and the manager's state machine, with a fake loader
(no TensorFlow): availability-preserving swaps, draining, extensions, retries, labels."""

from __future__ import annotations

import threading

import pytest

from support.fake_loader import FakeLoader, make_version, states
from tokenserve.errors import (ConfigError, FailedPreconditionError, InvalidRequestError,
                               ModelLoadError, ModelNotFoundError)
from tokenserve.lifecycle import ModelManager, ModelSpecConfig, VersionPolicy, VersionState
from tokenserve.lifecycle.model_config import parse_model_server_config
from tokenserve.lifecycle.server_protos import (parse_batching_parameters,
                                                parse_monitoring_config)


@pytest.fixture
def loader():
    return FakeLoader()


@pytest.fixture
def manager(loader):
    manager = ModelManager(loader, max_num_load_retries=1, load_retry_interval_s=0.01)
    yield manager
    manager.close(timeout_s=5)


def test_policies_select_versions():
    assert VersionPolicy.latest(2).select([3, 1, 2]) == {2, 3}
    assert VersionPolicy.all().select([1, 5]) == {1, 5}
    assert VersionPolicy.specific([1, 4]).select([1, 2, 3]) == {1}
    with pytest.raises(ConfigError):
        VersionPolicy.latest(0)


def test_model_server_config_text_format():
    specs = parse_model_server_config("""
        model_config_list {
          config { name: "a" base_path: "/m/a" model_platform: "tensorflow"
                   model_version_policy { specific { versions: 1 versions: 2 } }
                   version_labels { key: "stable" value: 1 } }
          config { name: "b" base_path: "/m/b" model_version_policy { all {} } }
          config { name: "c" base_path: "/m/c" }
        }""")
    assert [s.name for s in specs] == ["a", "b", "c"]
    assert specs[0].policy == VersionPolicy.specific([1, 2])
    assert specs[0].labels == {"stable": 1}
    assert specs[1].policy == VersionPolicy.all()
    assert specs[2].policy == VersionPolicy.latest(1)
    with pytest.raises(ConfigError, match="^Illegal to list model a multiple times in config "
                                          "list$"):
        parse_model_server_config('model_config_list { config { name: "a" base_path: "/x" } '
                                  'config { name: "a" base_path: "/y" } }')
    # protobuf's C++ TextFormat line, as tensorflow_model_server prints it
    with pytest.raises(ConfigError, match=r"^Error parsing text-format "
                                          r"tensorflow\.serving\.ModelServerConfig: 1:21: "):
        parse_model_server_config("model_config_list { nonsense: 1 }")


def test_monitoring_and_batching_text_protos():
    monitoring = parse_monitoring_config('prometheus_config { enable: true, path: "/m" }')
    assert monitoring.prometheus_enabled and monitoring.prometheus_path == "/m"
    assert not parse_monitoring_config("").prometheus_enabled
    batching = parse_batching_parameters("max_batch_size { value: 8 }\n"
                                         "batch_timeout_micros { value: 500 }\n"
                                         "allowed_batch_sizes: 4 allowed_batch_sizes: 8")
    assert (batching.max_batch_size, batching.batch_timeout_micros) == (8, 500)
    assert batching.allowed_batch_sizes == (4, 8)
    with pytest.raises(ConfigError):
        parse_batching_parameters("max_batch_size { value: 8 }\nallowed_batch_sizes: 4")


def test_swap_loads_new_before_unloading_old_and_drains_in_flight(tmp_path, loader, manager):
    make_version(tmp_path, 1)
    manager.apply_config([ModelSpecConfig("m", str(tmp_path))])
    assert states(manager, "m") == {1: VersionState.AVAILABLE}
    held = manager.acquire("m")
    old = held.__enter__()
    assert old.version == 1

    loader.gate = threading.Event()
    make_version(tmp_path, 2)
    manager.poll()
    # While version 2 is loading, version 1 keeps serving.
    assert states(manager, "m")[1] == VersionState.AVAILABLE
    with manager.acquire("m") as version:
        assert version.version == 1
    loader.gate.set()
    assert manager.wait_until_settled(5)
    # Version 2 is AVAILABLE; version 1 is UNLOADING until the held request finishes.
    assert states(manager, "m") == {2: VersionState.AVAILABLE, 1: VersionState.UNLOADING}
    with manager.acquire("m") as version:
        assert version.version == 2
    with pytest.raises(ModelNotFoundError, match=r"Specific\(m, 1\)"):
        with manager.acquire("m", version=1):
            pass
    assert not old.servable.closed
    held.__exit__(None, None, None)
    with manager._cond:
        assert manager._cond.wait_for(lambda: old.state == VersionState.END, 5)
    assert old.servable is None


def test_extensions_run_before_available_and_close_after_drain(tmp_path, loader, manager):
    events = []

    class Engine:
        def __init__(self, version):
            events.append(("built", version.version, version.state))

        def close(self):
            events.append(("closed",))

    class Stopper:
        def shutdown(self):
            events.append(("shutdown",))

    manager.register_extension("engine", Engine)
    manager.register_extension("stopper", lambda version: Stopper())
    manager.register_extension("nothing", lambda version: None)
    make_version(tmp_path, 1)
    manager.apply_config([ModelSpecConfig("m", str(tmp_path))])
    assert events == [("built", 1, VersionState.LOADING)]
    with manager.acquire("m") as version:
        assert isinstance(version.extensions["engine"], Engine)
        assert "nothing" not in version.extensions
        manager.apply_config([])  # model removed: unload starts, waits for us
        assert version.state == VersionState.UNLOADING
        assert events == [("built", 1, VersionState.LOADING)]
    with manager._cond:
        assert manager._cond.wait_for(lambda: version.state == VersionState.END, 5)
    assert events[-2:] == [("shutdown",), ("closed",)]  # reverse order of registration


def test_failed_load_is_retried_reported_and_keeps_old_version(tmp_path, loader, manager):
    make_version(tmp_path, 1)
    manager.apply_config([ModelSpecConfig("m", str(tmp_path))])
    make_version(tmp_path, 2, fail=True)
    manager.poll()
    assert manager.wait_until_settled(5)
    status = {s.version: s for s in manager.model_status("m")}
    assert status[2].state == VersionState.END
    assert status[2].error_code == "NOT_FOUND" and "cannot load" in status[2].error_message
    assert status[1].state == VersionState.AVAILABLE
    assert loader.calls.count(tmp_path / "2") == 2  # one try plus max_num_load_retries=1
    with manager.acquire("m") as version:
        assert version.version == 1
    manager.poll()  # unchanged files: not retried
    assert manager.wait_until_settled(5)
    assert loader.calls.count(tmp_path / "2") == 2
    (tmp_path / "2" / "FAIL").unlink()  # the copy completed
    (tmp_path / "2" / "variables").mkdir()
    manager.poll()
    assert manager.wait_until_settled(5)
    with manager.acquire("m") as version:
        assert version.version == 2


def test_failing_extension_fails_the_load(tmp_path, loader, manager):
    def broken(version):
        raise RuntimeError("engine would not start")

    manager.register_extension("engine", broken)
    make_version(tmp_path, 1)
    manager.apply_config([ModelSpecConfig("m", str(tmp_path))])
    [status] = manager.model_status("m")
    assert status.state == VersionState.END and "engine would not start" in status.error_message
    with pytest.raises(ModelNotFoundError, match=r"Latest\(m\)"):
        with manager.acquire("m"):
            pass


def test_labels_resolve_and_must_name_available_versions(tmp_path, loader, manager):
    make_version(tmp_path, 1)
    make_version(tmp_path, 2)
    spec = ModelSpecConfig("m", str(tmp_path), policy=VersionPolicy.all(),
                           labels={"stable": 1, "canary": 2})
    manager.apply_config([spec])
    with manager.acquire("m", label="stable") as version:
        assert version.version == 1
    with manager.acquire("m", label="canary") as version:
        assert version.version == 2
    assert [v.version for v in manager.available_versions("m")] == [2, 1]
    assert manager.labels("m") == {"stable": 1, "canary": 2}
    with pytest.raises(InvalidRequestError, match="Unrecognized servable version label: beta"):
        with manager.acquire("m", label="beta"):
            pass
    make_version(tmp_path, 3)
    bad = ModelSpecConfig("m", str(tmp_path), policy=VersionPolicy.all(), labels={"new": 3})
    with pytest.raises(FailedPreconditionError, match="version 3 of model m, which is not "
                                                      "currently available"):
        manager.apply_config([bad])  # refused whole, as TF Serving: v3 is not loaded
    assert manager.labels("m") == {"stable": 1, "canary": 2}
    assert 3 not in {s.version for s in manager.model_status("m")}


def test_unknown_model_and_status_messages(tmp_path, manager):
    manager.apply_config([])
    with pytest.raises(ModelNotFoundError, match=r"Servable not found for request: Latest\(x\)"):
        with manager.acquire("x"):
            pass
    with pytest.raises(ModelNotFoundError, match="Could not find any versions of model x"):
        manager.model_status("x")


def test_policy_change_and_model_removal_unload(tmp_path, loader, manager):
    for version in (1, 2, 3):
        make_version(tmp_path, version)
    manager.apply_config([ModelSpecConfig("m", str(tmp_path), policy=VersionPolicy.latest(2))])
    assert states(manager, "m") == {3: VersionState.AVAILABLE, 2: VersionState.AVAILABLE}
    manager.apply_config([ModelSpecConfig("m", str(tmp_path),
                                          policy=VersionPolicy.specific([1]))])
    with manager._cond:
        assert manager._cond.wait_for(
            lambda: states(manager, "m") == {1: VersionState.AVAILABLE, 2: VersionState.END,
                                             3: VersionState.END}, 5)
    manager.apply_config([])
    assert manager.model_names() == []
    with manager._cond:
        assert manager._cond.wait_for(lambda: states(manager, "m")[1] == VersionState.END, 5)


def test_catalog_lists_names_versions_and_labels_of_available_versions(tmp_path, manager):
    from tokenserve.lifecycle.catalog import servable_entries

    make_version(tmp_path / "a", 1)
    make_version(tmp_path / "a", 2)
    make_version(tmp_path / "b", 1, fail=True)
    manager.apply_config([
        ModelSpecConfig("a", str(tmp_path / "a"), policy=VersionPolicy.all(),
                        labels={"stable": 1, "canary": 2}),
        ModelSpecConfig("b", str(tmp_path / "b"))])
    entries = servable_entries(manager)
    assert [e.id for e in entries] == ["a", "a:2", "a:1", "a@canary", "a@stable"]
    assert entries[0].version == 2 and entries[-1].version == 1
    assert all(e.loaded_at is not None for e in entries)


def test_labels_for_unavailable_versions_when_allowed(tmp_path, loader):
    manager = ModelManager(loader, allow_labels_for_unavailable=True)
    try:
        make_version(tmp_path, 1)
        manager.apply_config([ModelSpecConfig("m", str(tmp_path), labels={"next": 2})])
        assert manager.labels("m") == {"next": 2}
        with pytest.raises(ModelNotFoundError, match=r"Specific\(m, 2\)"):
            with manager.acquire("m", label="next"):
                pass
        make_version(tmp_path, 2)
        manager.poll()
        assert manager.wait_until_settled(5)
        with manager.acquire("m", label="next") as version:
            assert version.version == 2
    finally:
        manager.close(timeout_s=5)


def test_new_base_path_replaces_the_models_versions(tmp_path, loader, manager):
    make_version(tmp_path / "old", 1)
    make_version(tmp_path / "new", 1)
    manager.apply_config([ModelSpecConfig("m", str(tmp_path / "old"))])
    with manager.acquire("m") as version:
        old = version
    manager.apply_config([ModelSpecConfig("m", str(tmp_path / "new"))])
    with manager.acquire("m") as version:
        assert version.path == tmp_path / "new" / "1"
    with manager._cond:
        assert manager._cond.wait_for(lambda: old.state == VersionState.END, 5)


# ---- reloads never take serving down before the new config serves -----------------------------
# (docs/migrating-from-tf-serving.md#lifecycle)

def test_reload_to_a_missing_base_path_reports_and_keeps_serving(tmp_path, loader, manager):
    make_version(tmp_path / "a", 1)
    make_version(tmp_path / "b", 1)
    manager.apply_config([ModelSpecConfig("a", str(tmp_path / "a")),
                          ModelSpecConfig("b", str(tmp_path / "b"))])
    with pytest.raises(ModelLoadError, match=r"1 model\(s\) did not become available: "
                                             r"\{\{name: c\} Could not find base path "):
        manager.apply_config([ModelSpecConfig("c", str(tmp_path / "c"))])
    for name in ("a", "b"):  # still serving, still in the status and the catalog
        with manager.acquire(name) as version:
            assert version.state == VersionState.AVAILABLE
        assert states(manager, name) == {1: VersionState.AVAILABLE}
    assert manager.model_names() == ["a", "b", "c"]
    make_version(tmp_path / "c", 1)  # the new config can load now: then the old one goes
    manager.poll()
    with manager._cond:
        assert manager._cond.wait_for(
            lambda: all(states(manager, n) == {1: VersionState.END} for n in ("a", "b")), 5)
    with manager.acquire("c") as version:
        assert version.path == tmp_path / "c" / "1"
    with pytest.raises(ModelNotFoundError, match=r"Latest\(a\)"):
        with manager.acquire("a"):
            pass
    assert manager.model_names() == ["c"]


def test_a_missing_or_empty_base_path_is_logged_once_per_reason(tmp_path, loader,
                                                                caplog):
    manager = ModelManager(loader)
    base = tmp_path / "m"
    with caplog.at_level("WARNING", logger="tokenserve.lifecycle"):
        manager.apply_config([ModelSpecConfig("m", str(base))], wait=False)
        manager.poll()
        base.mkdir()
        manager.poll()
        manager.poll()
        make_version(base, 1)
        manager.poll()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"m: could not find base path {base} (waiting for it to appear)",
                        f"m: no versions found under base path {base}. Did you forget to name "
                        f"your leaf directory as a number (eg. '/1/')?"]
    with manager._cond:
        assert manager._cond.wait_for(lambda: states(manager, "m") == {
            1: VersionState.AVAILABLE}, 5)
    manager.close()


def test_reload_to_an_empty_or_failing_base_path_keeps_the_old_versions(tmp_path, loader,
                                                                        manager):
    make_version(tmp_path / "old", 1)
    (tmp_path / "empty").mkdir()
    manager.apply_config([ModelSpecConfig("m", str(tmp_path / "old"))])
    with pytest.raises(ModelLoadError, match=r"No versions of servable m found under base "
                                             r"path .*Did you forget to name your leaf "):
        manager.apply_config([ModelSpecConfig("m", str(tmp_path / "empty"))])
    with manager.acquire("m") as version:
        assert version.path == tmp_path / "old" / "1"
    make_version(tmp_path / "bad", 4, fail=True)
    with pytest.raises(ModelLoadError, match=r"\{name: m version: 4\} due to error: cannot load"):
        manager.apply_config([ModelSpecConfig("m", str(tmp_path / "bad"))])
    with manager.acquire("m") as version:
        assert version.path == tmp_path / "old" / "1"
    make_version(tmp_path / "good", 2)
    manager.apply_config([ModelSpecConfig("m", str(tmp_path / "good"))])  # loads: no error
    with manager.acquire("m") as version:
        assert version.path == tmp_path / "good" / "2"
    assert states(manager, "m") == {2: VersionState.AVAILABLE}


def test_a_held_model_put_back_in_the_config_keeps_its_versions(tmp_path, loader, manager):
    make_version(tmp_path / "a", 1)
    manager.apply_config([ModelSpecConfig("a", str(tmp_path / "a"))])
    with manager.acquire("a") as version:
        serving = version
    with pytest.raises(ModelLoadError):
        manager.apply_config([ModelSpecConfig("ghost", str(tmp_path / "ghost"))])
    manager.apply_config([ModelSpecConfig("a", str(tmp_path / "a"))])  # no error: a serves
    with manager.acquire("a") as version:
        assert version is serving  # not loaded again
    assert loader.calls == [tmp_path / "a" / "1"]
    assert manager.model_names() == ["a"]
