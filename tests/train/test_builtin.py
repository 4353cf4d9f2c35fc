"""The shipped built-in models: they load, they learned Python, and they export."""

import json
import math
from pathlib import Path

import pytest

from support.tiny_models import greedy_by_full_forward
from tokenserve.model.checkpoint import BUILTIN_DIR, load_source
from tokenserve.train.corpus import Corpus, token_stream
from tokenserve.train.trainer import holdout_windows, perplexity


@pytest.fixture(scope="module")
def holdout_stream():
    corpus = Corpus.from_stdlib(holdout_fraction=0.05)
    from tokenserve.model.tokenizer import Tokenizer

    return token_stream(corpus.holdout_texts, Tokenizer.load(BUILTIN_DIR / "tokenizer.json"))


def test_shipped_files_fit_the_size_budget():
    sizes = [p.stat().st_size for p in BUILTIN_DIR.glob("*.safetensors")]
    assert len(sizes) == 2 and sum(sizes) <= 32 * 2**20


@pytest.mark.parametrize("source,family", [("builtin", "transformer"),
                                           ("builtin-lstm", "lstm")])
def test_builtin_models_have_learned_python(source, family, holdout_stream):
    model, tokenizer, config = load_source(source)
    assert config.model.family == family and config.model.vocab_size == tokenizer.vocab_size
    # A uniform guess is perplexity 8192, and so is, nearly, an untrained model.
    assert perplexity(model, holdout_windows(holdout_stream, 256, 8)) < 250


@pytest.mark.slow
@pytest.mark.parametrize("source,family", [("builtin", "transformer"),
                                           ("builtin-lstm", "lstm")])
def test_shipped_weights_have_the_reported_perplexity(source, family, holdout_stream):
    model, _, _ = load_source(source)
    reported = json.loads((BUILTIN_DIR / "train_report.json").read_text())["models"][family]
    windows = holdout_windows(holdout_stream, 256, 10**9)
    assert len(windows) == reported["holdout_windows"]
    assert math.isclose(perplexity(model, windows), reported["holdout_perplexity"], rel_tol=1e-3)


def test_builtin_transformer_writes_an_indented_function_body():
    model, tokenizer, config = load_source("builtin")
    prompt = "def read_config(path):"
    ids = tokenizer.encode(prompt)
    text = tokenizer.decode(ids + greedy_by_full_forward(model, ids, 24))
    assert text.startswith(prompt)
    assert text[len(prompt):].startswith("\n    "), text  # a new line, then an indented body


def test_serve_exports_the_builtin_model_in_a_child_process(monkeypatch, tmp_path):
    """A first `serve` makes the built-in export in a child process, so the server's heap
    never holds the export's graphs: here the in-process exporter is broken, and the export
    still appears, complete, under a fresh cache."""
    from tokenserve.export import cached_exports
    from tokenserve.export.exporter import version_dirs
    from tokenserve.server.config import ServeConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def in_process_export(*args, **kwargs):
        raise AssertionError("serve exported the built-in model in its own process")

    monkeypatch.setattr(cached_exports, "export_model", in_process_export)
    (spec,) = ServeConfig().model_specs()
    base = Path(spec.base_path)
    assert base.is_relative_to(tmp_path)
    (version,) = version_dirs(base)
    assert (base / str(version) / "saved_model.pb").is_file()
    # a second start finds it without exporting again
    assert ServeConfig().model_specs()[0].base_path == spec.base_path


def test_a_changed_exporter_gets_a_fresh_export(tmp_path):
    """The cache key follows the code that writes the graph: the same sources hash the same,
    and one changed line in the model or export code gives a new key (a new export), where
    code outside them does not."""
    import shutil

    from tokenserve.export import cached_exports

    package = Path(cached_exports.__file__).resolve().parent.parent
    copy = tmp_path / "tokenserve"
    for name in ("export", "model", "server"):
        shutil.copytree(package / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    before = cached_exports.exporter_fingerprint(copy)
    assert before == cached_exports.exporter_fingerprint(package)
    (copy / "server" / "config.py").write_text("# serving code: not the graph\n")
    (copy / "export" / "cached_exports.py").write_text("# where exports go: not the graph\n")
    assert cached_exports.exporter_fingerprint(copy) == before
    module = copy / "export" / "module.py"
    module.write_text(module.read_text() + "\nMAX_INIT_STATE_BYTES = 1 << 20\n")
    assert cached_exports.exporter_fingerprint(copy) != before


def test_processes_starting_at_once_on_a_cold_cache_export_once(tmp_path):
    """Two exporters of one cache entry at once (test workers, replicas starting together):
    one exports while the other waits on the lock, then finds that version and writes none.
    Threads stand in for processes: flock excludes separate opens of the lock file alike."""
    import threading
    import time

    from tokenserve.export.cached_exports import _export_once
    from tokenserve.export.exporter import staged_version, version_dirs

    base = tmp_path / "builtin-x"
    calls = []

    def export():
        calls.append(threading.current_thread().name)
        with staged_version(base) as (staging, _):
            staging.mkdir()
            time.sleep(0.3)  # the other thread arrives while this export runs
            (staging / "saved_model.pb").write_bytes(b"")

    threads = [threading.Thread(target=_export_once, args=(base, export)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and version_dirs(base) == [1]
