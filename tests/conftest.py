"""Shared fixtures: tiny random-weight models built from a config (no downloads), and the real tokenizer."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import register_random, settings
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

# Eval's closing report draws five figures (~2 s of CPU, ~95% of a small run's report) that only a few tests
# look at: those ask for `eval_plots`; every other eval (subprocesses included) writes the same tables and
# summary.md without them (`analysis.report.plots_wanted`). `ripplekv report` always draws.
os.environ.setdefault("RIPPLEKV_PLOTS", "0")
# Decoding attention takes our path in every test (subprocesses too) unless a test sets another: a device's
# measured choice (`engine.decode_attention`) would make exact comparisons depend on the machine.
os.environ.setdefault("RIPPLEKV_DECODE_ATTENTION", "ours")

# `make test` runs the files over one pytest-xdist worker per core: each worker (and what it starts) computes on
# one torch thread, since two workers of two threads each on two cores spend their time waiting for each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Property tests (hypothesis) draw the same examples on every run: `make test`, CI and a plain pytest pass or fail
# by the commit, never by chance, and keep no example database between runs. `make test-explore`
# (tests/explore.py) asks for the `explore` profile (`--hypothesis-profile explore`): fresh examples under a
# printed seed, a failure's reproduce blob printed too, to be pinned as an `@example`.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile("ci")


class _TorchRandom:
    """torch's global generator as hypothesis sees a `random.Random`: it seeds it before each example, as it does
    Python's and numpy's, so an example draws the same tensors whichever example or test ran before it."""

    seed = staticmethod(torch.manual_seed)
    getstate = staticmethod(torch.get_rng_state)
    setstate = staticmethod(torch.set_rng_state)


TORCH_RANDOM = _TorchRandom()  # hypothesis keeps a weak reference only
register_random(TORCH_RANDOM)


def pytest_configure(config):
    config.addinivalue_line("markers", "property: a hypothesis test (marked below); `make test-explore` runs these "
                            "with fresh examples")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Every test (and the module fixtures it starts) begins from the same global random state, whatever ran
    before it on its pytest-xdist worker: which files a worker takes changes from run to run."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def load_script(name: str):
    """scripts/NAME.py imported as a module (scripts are not a package), for tests of its functions."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_refusal(name: str, *args, cwd: Path, monkeypatch, capsys) -> str:
    """scripts/NAME.py's main() run in-process from `cwd` with `args`: it must exit 2; what it wrote to stderr."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))  # its sibling modules
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *map(str, args)])
    with pytest.raises(SystemExit) as stop:
        load_script(name).main()
    assert stop.value.code == 2
    return capsys.readouterr().err


HIDDEN = TINY["hidden_size"]  # the attention inputs' width of the tiny models (and of states built without one)
HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]  # the tiny models' head size (Q-filters' width)


def tiny_llama(vocab_size: int = 101, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **{**TINY, **overrides})).eval()


def tiny_qwen2(vocab_size: int = 101, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, **{**TINY, **overrides})).eval()


# Hybrid attention: sliding-window layers beside global ones, as in Gemma 2/3. A window of 16 against prompts of
# 60+ tokens makes the sliding layers hold less than the prompt and evict while decoding.
HYBRID_WINDOW = 16
ALTERNATING = ["sliding_attention", "full_attention"] * 2


def tiny_gemma3(vocab_size: int = 101, seed: int = 0, **overrides):
    """Gemma 3's layout: five sliding layers per global one (its default pattern), q/k norms, RoPE by layer type."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=vocab_size, **{**TINY, "num_hidden_layers": 6, "head_dim": 16,
                                                        "query_pre_attn_scalar": 16, "sliding_window": HYBRID_WINDOW,
                                                        **overrides})
    return Gemma3ForCausalLM(config).eval()


def tiny_gemma2(vocab_size: int = 101, seed: int = 0, **overrides):
    """Gemma 2's layout (sliding and global layers alternating), without its logit soft-capping (refused)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=vocab_size, **{**TINY, "head_dim": 16, "query_pre_attn_scalar": 16,
                                                    "sliding_window": HYBRID_WINDOW, "attn_logit_softcapping": None,
                                                    "final_logit_softcapping": None, **overrides})
    return Gemma2ForCausalLM(config).eval()


def tiny_qwen2_sliding(vocab_size: int = 101, seed: int = 0, **overrides):
    """Qwen2 with `use_sliding_window` and alternating `layer_types`: a supported family made hybrid."""
    return tiny_qwen2(vocab_size, seed, **{"use_sliding_window": True, "sliding_window": HYBRID_WINDOW,
                                           "layer_types": ALTERNATING, **overrides})


def _no_stop(build):
    """A builder whose model has no end-of-sequence token: Gemma's (id 1) is among a tiny vocabulary's greedy
    picks, and `generate(min_new_tokens=...)` would then hide it where our greedy decode, given no stop, keeps it."""
    def built(*args, **kwargs):
        model = build(*args, **kwargs)
        model.generation_config.eos_token_id = None
        return model

    return built


HYBRID_BUILDERS = {"gemma3": _no_stop(tiny_gemma3), "gemma2": _no_stop(tiny_gemma2),
                   "qwen2-sliding": _no_stop(tiny_qwen2_sliding)}


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request):
    """A tiny random model of each supported family with grouped KV heads."""
    return tiny_llama() if request.param == "llama" else tiny_qwen2()


@pytest.fixture(scope="session")
def tokenizer():
    """The real bundled SmolLM2 tokenizer (its model is dequantized and cached on first use)."""
    from ripplekv.engine.models import load_tokenizer

    return load_tokenizer()


# The test files that take longest, heaviest first (seconds of one run on 2 cores, from --junitxml: 79, 58, 57,
# 42, 35, 31, 30, 30, 26). Under `--dist loadfile` the workers take files in collection order, so these go first:
# a heavy file taken last would leave one worker running it alone while the other is done.
HEAVIEST = ("test_distributed.py", "test_ruler.py", "test_reproduce.py", "test_resume_equal.py", "test_interrupts.py",
            "test_evaluate.py", "test_api.py", "test_report.py", "test_lm_eval_backend.py")


def pytest_collection_modifyitems(items):
    """Whatever loads the real bundled model or starts a Ray cluster is `slow`, wherever it is: `pytest -m "not
    slow"` then leaves out every test that needs them (their session fixtures never start). Every hypothesis
    test is `property`. The heaviest files run first (`HEAVIEST`)."""
    for item in items:
        if {"bundled_model", "ray_cluster"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)  # what `make test-explore` runs
    rank = {name: index for index, name in enumerate(HEAVIEST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVIEST)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def bundled_model():
    """The real bundled SmolLM2 (model, tokenizer, source) on the CPU in float32, loaded once per session
    offline: the slow tests that need the real model share it (none of them changes its weights)."""
    from ripplekv.engine.models import load_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return load_model(None, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama with the real tokenizer's vocabulary, saved as a local model directory."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_llama(vocab_size=len(tokenizer), num_hidden_layers=4, hidden_size=32, intermediate_size=64)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def eval_plots(monkeypatch):
    """Eval's report draws its figures in this test (the suite leaves them out elsewhere)."""
    monkeypatch.setenv("RIPPLEKV_PLOTS", "1")


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run the real `ripplekv` entry point in-process: run_cli(*args) -> (exit code, stdout, stderr)."""
    from ripplekv.cli import app as cli

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["ripplekv", *map(str, args)])
        code = 0
        try:
            cli.main()
        except SystemExit as stop:
            code = stop.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def invoke(*args, cwd=None) -> subprocess.CompletedProcess:
    """The `ripplekv` entry point in this process, as a subprocess would report it (returncode, stdout,
    stderr), for module-scoped fixtures that cannot take `run_cli`: a fresh interpreter per command costs
    seconds of imports that most CLI tests do not need (the installed command keeps tests of its own)."""
    import contextlib
    import io

    from ripplekv.cli import app as cli

    argv = ["ripplekv", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(pytest.MonkeyPatch.context()).setattr(sys, "argv", argv)
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            cli.main()
        except SystemExit as stop:
            code = stop.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


class StubTokenizer:
    """Enough of a tokenizer for KVzip's request on a tiny model: small ids, no chat template."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [5 + ord(c) % 90 for c in text[:12]]


def satisfy(state, tokenizer=None):
    """Give a prefilled state what the answer-aware and request-phrasing scorers need (oracle, KVzip), as the
    engine records them: a question [3] read after the prompt, then the full cache's answer [7, 8, 9]; and, where
    the prompt had no question part of its own, Finch's question queries: those of its last 8 tokens."""
    from ripplekv.engine.prefill import Requirements
    from ripplekv.engine.recorders import WINDOW_QUERIES, SampleContext, record_context, record_reference
    from ripplekv.methods.finch import QUESTION_QUERIES
    from ripplekv.methods.kvzip import TOKENIZER
    from ripplekv.methods.oracle import REFERENCE_ANSWER

    needs = Requirements(signals={TOKENIZER, REFERENCE_ANSWER})
    record_context(state, needs, SampleContext(tokenizer or StubTokenizer(), (3,)))
    record_reference(state, [7, 8, 9])
    queries = state.signals.get(WINDOW_QUERIES)
    if QUESTION_QUERIES not in state.signals and queries and state.length > 1:  # Finch: the last 8 tokens as the question
        width = min(8, state.length - 1, queries[0].shape[1])
        state.signals[QUESTION_QUERIES] = [layer[:, layer.shape[1] - width:] for layer in queries]
    if "hidden_states" not in state.signals:  # a state built without a prefill: attention inputs of every_method's width
        generator = torch.Generator().manual_seed(0)
        state.signals["hidden_states"] = [torch.randn(state.length, HIDDEN, generator=generator)
                                          for _ in range(state.num_layers)]
    return state


def every_method(num_layers: int, folder, only: str | None = None, kv_heads: int = 1, head_dim: int = HEAD_DIM) -> dict:
    """Every registered method, with the inputs the ones that need them get (`method_inputs`).

    Method tests loop over this, so a newly registered method is covered without touching them.
    """
    from ripplekv.methods import make_method, method_names

    needs = method_inputs(num_layers, folder, kv_heads, only, head_dim)
    return {name: make_method(name, **needs.get(name, {})) for name in method_names() if only in (None, name)}


def method_inputs(num_layers: int, folder, kv_heads: int = 1, only: str | None = None,
                  head_dim: int = HEAD_DIM) -> dict[str, dict]:
    """The options of the presets that need an input, by preset: an allocation, a route, an LU-KV curve, a
    KVzap surrogate, FastKVzip gates, DuoAttention gates and Q-filters (of `head_dim`) for `num_layers` x `kv_heads` (the files written to `folder`;
    `only`: that preset's alone)."""
    from ripplekv.methods.lukv.method import RATIOS
    from ripplekv.pipeline.head_curves import write_curve

    route = folder / "route.csv"
    choices = ("snapkv", "streamingllm", "random", "snapkv:kernel=3")
    route.write_text("layer,method\n" + "".join(f"{i},{choices[i % len(choices)]}\n" for i in range(num_layers)))
    multipliers = tuple(float(m) for m in torch.linspace(2.0, 0.5, num_layers).tolist())
    needs = {"ripplekv": {"multipliers": multipliers}, "depthkv": {"multipliers": multipliers},
             "compresskv": {"errors": multipliers}, "routed": {"route": str(route)},
             "routed-ripplekv": {"route": str(route), "multipliers": multipliers}}
    if only in (None, "lukv"):  # heads pruned unequally around each global ratio (mean = the ratio)
        tilt = np.linspace(0.6, 1.4, num_layers * kv_heads).reshape(num_layers, kv_heads)
        curve = np.clip(RATIOS[:, None, None] * tilt / tilt.mean(), 0.0, 0.99)
        needs["lukv"] = {"curve": str(write_curve(folder / "lukv.csv", curve, {}))}
    if only in (None, "kvzap"):  # a random-weight surrogate over the tiny models' attention inputs
        from ripplekv.methods.kvzap import surrogate as kvzap_surrogate

        with torch.random.fork_rng():
            torch.manual_seed(0)
            layers = kvzap_surrogate.build("mlp", HIDDEN, kv_heads, num_layers)
        needs["kvzap"] = {"weights": str(kvzap_surrogate.save(Path(folder) / "kvzap.safetensors", "mlp", layers, {}))}
    if only in (None, "qfilter"):  # random unit filters, one per (layer, KV head)
        from ripplekv.methods.qfilter import filters as qfilters

        drawn = np.random.default_rng(0).standard_normal((num_layers, kv_heads, head_dim))
        drawn /= np.linalg.norm(drawn, axis=-1, keepdims=True)
        needs["qfilter"] = {"weights": str(qfilters.save(Path(folder) / "qfilter.safetensors", drawn, {}))}
    if only in (None, "duoattention"):  # distinct gates, a streaming window of 2 sinks + 6 recent
        from ripplekv.methods.duoattention.gates import write_gates

        gates = np.linspace(0.05, 0.95, num_layers * kv_heads)[::-1].reshape(num_layers, kv_heads).tolist()
        needs["duoattention"] = {"gates": str(write_gates(Path(folder) / "duo.json", gates, 2, 6, {}))}
    if only in (None, "fastkvzip"):  # untrained gates (torch's initialisation), one per layer
        from ripplekv.methods.fastkvzip import gate as fastkvzip_gate

        group = TINY["num_attention_heads"] // kv_heads
        with torch.random.fork_rng():
            drawn = [fastkvzip_gate.initial(HIDDEN, kv_heads, group, seed=layer) for layer in range(num_layers)]
        needs["fastkvzip"] = {"weights": str(fastkvzip_gate.save(Path(folder) / "fastkvzip.safetensors", drawn, {}))}
    return needs


def check_fidelity(rows) -> None:
    """What an eval's KL and agreement must satisfy against its own full rows (checks that can fail, where a
    range check cannot: KL is clamped at 0 and agreement is a share): the full row is 0 and 1 exactly; a
    variant's agreement counts whole tokens of the full answer; full agreement means the full answer itself;
    any disagreement means a KL above 0."""
    full = {(r["task"], r["id"]): r for r in rows if r["method"] == "full"}
    assert all(r["kl"] == 0.0 and r["agreement"] == 1.0 for r in full.values())
    for r in rows:
        if r["method"] == "full":
            continue
        reference = full[(r["task"], r["id"])]
        agreed = r["agreement"] * reference["new_tokens"]
        assert abs(agreed - round(agreed)) < 1e-6, r
        if r["agreement"] == 1.0:
            assert (r["prediction"], r["new_tokens"]) == (reference["prediction"], reference["new_tokens"]), r
        else:
            assert r["kl"] > 0.0, r


def without_peak_memory(text):
    """A predictions file (str or bytes) without its measured `peak_memory_bytes` fields: the one value that
    differs between two runs that are otherwise byte-identical."""
    if isinstance(text, bytes):
        return re.sub(rb', "peak_memory_bytes": \d+', b"", text)
    return re.sub(r', "peak_memory_bytes": \d+', "", text)


def unmeasured(name: str, data: bytes) -> bytes:
    """A run file without what is measured: predictions' peak memory, summary.md's closing time section."""
    if name == "predictions.jsonl":
        return without_peak_memory(data)
    if name == "summary.md":
        return data.split(b"\n## Where the time went")[0]
    if name == "index.html":  # the page names its folder (title, data): equal runs in two folders differ only there
        data = re.sub(rb"<title>[^<]*</title>", b"<title></title>", data)
        return re.sub(rb'"(title|folder)":"[^"]*"', rb'"\1":""', data)
    return data


def run_files(folder: Path) -> dict[str, bytes]:
    """A run folder's files by name (the lock and the measured timings.csv left out), without measured fields."""
    return {p.name: unmeasured(p.name, p.read_bytes())
            for p in sorted(folder.iterdir()) if p.is_file() and p.name not in (".lock", "timings.csv")}
