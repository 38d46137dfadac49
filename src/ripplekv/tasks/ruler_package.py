"""Running RULER's own sample generators (the `nvidia-long-context-eval` package) in this process, offline.

RULER's generators are scripts (`data/synthetic/<family>.py`) that parse their arguments, load a tokenizer and
seed the global generators at import, and that `prepare.py` runs one subprocess per task. Here a script's own
source runs as a fresh module per request, with the arguments `prepare.py` would pass, and its sample
function is then called as its `main` would. Four things differ from a subprocess, none in what is generated:

- the tokenizer is the package's own `HFTokenizer` class around the caller's tokenizer (not loaded by path);
- nltk's `sent_tokenize` needs the trained punkt model, a download: it is replaced by nltk's Punkt tokenizer
  with default parameters (no learned abbreviations), the one substitution (docs/usage.md, "Data");
- niah.py's list of every adjective-noun key (6.2M strings, ~50 s and ~0.5 GB to build and sort) is
  replaced by `KeyWords`, the same sorted list computed per index (tests check the two are equal);
- the global `random` / numpy states are restored afterwards and the scripts' progress output is silenced.

One guard: a script retries a sample that does not fit in a bare `while True: try ... except` that never ends
when even its smallest haystack is too long (QA's first 10 documents at a short target). The script's
`generate_input_output` is watched; when it is called with the same arguments more often in a row than the
samples asked for could explain, it answers an empty sample so the loop ends, and the request fails with one
line asking for a longer target (`TooShort`).
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import io
import random
import sys
from functools import cache
from pathlib import Path

from ripplekv.errors import UserError

PACKAGE = "long_context_eval"
MISSING = ("the RULER suite needs `nvidia-long-context-eval`; run `make install` "
           "(or `pip install --no-deps nvidia-long-context-eval==26.3`)")
# The seed RULER's prepare.py gives the first (only) chunk of a task: eval seed 0 reproduces RULER's samples.
RULER_SEED = 42
# niah.py's key list, dropped from its source and given as `KeyWords` (see the module docstring).
KEY_LIST_NAME = "words"


def package_dir() -> Path:
    from ripplekv.engine.models import installed_package_dir

    return installed_package_dir(PACKAGE, MISSING)


class KeyWords:
    """`sorted(set(f"{adj}-{noun}" for adj in adjs for noun in nouns))`, computed per index.

    Sorted by `adj + "-"`, the adjectives fall into blocks: an adjective alone (its keys are the sorted nouns
    behind one fixed prefix) or one with the adjectives that extend it by a hyphen ("x" and "x-rated"), whose
    keys interleave and are sorted once (a few thousand strings)."""

    def __init__(self, adjs, nouns):
        self.nouns = sorted(set(nouns))
        order = sorted(set(adjs), key=lambda adj: adj + "-")
        self.blocks: list = []
        self.starts = [0]
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and order[j].startswith(order[i] + "-"):
                j += 1
            block = order[i] if j == i + 1 else sorted({f"{a}-{n}" for a in order[i:j] for n in self.nouns})
            self.blocks.append(block)
            self.starts.append(self.starts[-1] + (len(self.nouns) if isinstance(block, str) else len(block)))
            i = j

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> str:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        b = bisect.bisect_right(self.starts, index) - 1
        block, offset = self.blocks[b], index - self.starts[b]
        return f"{block}-{self.nouns[offset]}" if isinstance(block, str) else block[offset]


@cache
def key_words() -> KeyWords:
    import wonderwords

    read = wonderwords.random_word._get_words_from_text_file
    return KeyWords(read("adjectivelist.txt"), read("nounlist.txt"))


def _assigns(statement, name: str) -> bool:
    return isinstance(statement, ast.Assign) and any(
        isinstance(target, ast.Name) and target.id == name for target in statement.targets)


@cache
def compiled_script(family: str, lazy_keys: bool = True):
    """The generator script's code, niah.py's key-list statements left out when `lazy_keys`."""
    path = package_dir() / "data" / "synthetic" / f"{family}.py"
    if not path.is_file():
        raise UserError(f"RULER generator {path} is missing; reinstall nvidia-long-context-eval==26.3")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if family == "niah" and lazy_keys:
        kept = [s for s in tree.body if not _assigns(s, KEY_LIST_NAME)]
        if len(tree.body) - len(kept) != 2:  # the list and its sorted copy: anything else is another package version
            raise UserError(f"{path} does not build its key list as nvidia-long-context-eval 26.3 does; "
                            "install nvidia-long-context-eval==26.3")
        tree.body = kept
    return compile(tree, str(path), "exec")


@contextlib.contextmanager
def _script_environment(argv: list[str], tokenizer):
    """sys.argv, the tokenizer and sentence splitter the script imports, its sibling modules; everything
    global it touches is put back afterwards."""
    from unittest import mock

    import nltk.tokenize
    import numpy as np
    from long_context_eval.data import tokenizer as package_tokenizer
    from long_context_eval.data.synthetic import constants as package_constants
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    wrapped = package_tokenizer.HFTokenizer.__new__(package_tokenizer.HFTokenizer)
    wrapped.tokenizer = tokenizer  # the package's class, around the caller's tokenizer
    saved_random, saved_numpy, saved_path = random.getstate(), np.random.get_state(), list(sys.path)
    siblings = {"tokenizer": package_tokenizer, "constants": package_constants}  # `from tokenizer import ...`
    saved_modules = {name: sys.modules.get(name) for name in siblings}
    try:
        sys.modules.update(siblings)
        with mock.patch.object(sys, "argv", argv), \
                mock.patch.object(package_tokenizer, "select_tokenizer", lambda *_: wrapped), \
                mock.patch.object(nltk.tokenize, "sent_tokenize", PunktSentenceTokenizer().tokenize), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as said:
            yield said
    finally:
        random.setstate(saved_random)
        np.random.set_state(saved_numpy)
        sys.path[:] = saved_path
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


STUCK = "\x00ruler: no sample fits"  # the answer of the empty sample that ends a stuck retry loop
RETRIES = 100  # identical calls in a row beyond the samples asked for: the script is retrying forever


def _watch(namespace: dict, num_samples: int) -> dict:
    """Wrap the script's `generate_input_output` (see the module docstring); returns the flag it sets."""
    original = namespace.get("generate_input_output")
    state = {"last": None, "streak": 0, "stuck": False}

    def watched(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        state["streak"] = state["streak"] + 1 if key == state["last"] else 1
        state["last"] = key
        if state["stuck"] or state["streak"] > num_samples + RETRIES:
            state["stuck"] = True
            return "", [STUCK]
        return original(*args, **kwargs)

    if original is not None:
        namespace["generate_input_output"] = watched
    return state


def run_script(family: str, arguments: dict, tokenizer, call, lazy_keys: bool = True):
    """Run generator `family` (niah, variable_tracking, ...) as its own module with `arguments` (option name ->
    value, as prepare.py passes them) and return `call(module_globals)`: the samples its function makes."""
    argv = [f"{family}.py"]
    for name, value in arguments.items():
        argv += [f"--{name}", str(value)]
    code = compiled_script(family, lazy_keys)
    namespace = {"__name__": f"ruler_{family}", "__file__": code.co_filename}
    if family == "niah" and lazy_keys:
        namespace[KEY_LIST_NAME] = key_words()
    with _script_environment(argv, tokenizer) as said:
        try:
            exec(code, namespace)  # the script's own top level: arguments, seeding, haystack, key lists
        except SystemExit:  # argparse refused the arguments: a package version that takes others
            lines = said.getvalue().strip().splitlines() or ["(no message)"]
            raise UserError(f"RULER's {family}.py refused its arguments ({lines[-1]}); "
                            "install nvidia-long-context-eval==26.3") from None
        watch = namespace["_ruler_watch"] = _watch(namespace, int(arguments.get("num_samples", 1)))
        try:
            made = call(namespace)
        except Exception:
            if not watch["stuck"]:
                raise
            made = None
    if watch["stuck"] or any(STUCK in sample.get("outputs", ()) for sample in made):
        raise UserError(f"RULER's {family} task cannot fit even its smallest haystack into "
                        f"{arguments.get('max_seq_length')} tokens; pass a longer --target-tokens{haystack_step(family)}")
    return made


def haystack_step(family: str) -> str:
    """What a task family's haystack grows by, where it sets the shortest target (QA's documents); a hint about
    one family is never quoted for another."""
    return " (its QA tasks add 10 documents at a time: about 2000 tokens or more)" if family == "qa" else ""


def generate(family: str, arguments: dict, tokenizer, num_samples: int, max_seq_length: int,
             depths: list[int] | None = None, lazy_keys: bool = True) -> list[dict]:
    """RULER's samples (`{"index", "input", "outputs", "length"}`) for one task, as its script's `main` makes them.

    `depths` (niah only): sample i is made alone with the needle depths RULER draws from set to `[depths[i]]`
    (the package's `DEPTHS` list), from the same running generator, so a depth sweep is RULER's own sample at
    the depth asked for."""

    def call(g):
        if family in ("niah", "qa"):
            if depths is None:
                return g["generate_samples"](num_samples=num_samples, max_seq_length=max_seq_length, save_dir=None)
            made = []
            for index in range(num_samples):
                if g["_ruler_watch"]["stuck"]:
                    break
                g["DEPTHS"] = [depths[index]]
                made.extend(g["generate_samples"](num_samples=1, max_seq_length=max_seq_length, save_dir=None))
                made[-1]["index"] = index
            return made
        if family == "variable_tracking":  # main(): a short in-context example first, then the samples
            args = g["args"]
            make = g["sys_vartrack_w_noise_random"]
            example = make(num_samples=1, max_seq_length=500, incremental=5, num_chains=args.num_chains,
                           num_hops=args.num_hops)[0]
            return make(num_samples=num_samples, max_seq_length=max_seq_length, num_chains=args.num_chains,
                        num_hops=args.num_hops, icl_example=example)
        if family == "common_words_extraction":
            return g["sys_word_pair_random"](num_samples=num_samples, max_seq_length=max_seq_length, save_dir=None)
        if family == "freq_words_extraction":
            return g["sys_kwext"](num_samples=num_samples, max_seq_length=max_seq_length, incremental=10)
        raise UserError(f"unknown RULER task family {family!r}")

    if depths is not None and (family != "niah" or len(depths) < num_samples):
        raise UserError("a depth per sample applies to niah tasks only")
    return run_script(family, arguments, tokenizer, call, lazy_keys)
