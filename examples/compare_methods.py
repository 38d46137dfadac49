"""Compare compression methods on your own text: every method and budget from one prefill.

    python examples/compare_methods.py [TEXT_FILE] [--question Q] [--methods snapkv,ripplekv] [--budget 64]

Prints each variant's answer, the entries it kept and its KL to the full cache's answer (lower is closer).
A mistake (an unknown method, a missing file, a budget of 0) is one line and exit code 2, as in the CLI:
`ripplekv.UserError` carries a message that says what to do.
"""

import argparse
import sys
from pathlib import Path

import ripplekv

STORY = ("Mira repaired clocks in a narrow shop by the river. Each morning she wound the tall clock by the door, "
         "then opened the shutters. Customers brought watches that had stopped on important days. ") * 5
STORY += "The oldest clock in the shop had been built in 1789 by her great-grandfather. " + STORY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", nargs="?", help="a text file (default: a short built-in story)")
    parser.add_argument("--question", default="When was the oldest clock in the shop built?")
    parser.add_argument("--methods", default="snapkv,ripplekv")
    parser.add_argument("--budget", type=int, action="append", help="repeatable; default 64")
    args = parser.parse_args()
    try:
        context = Path(args.text).read_text(encoding="utf-8") if args.text else STORY
    except (OSError, UnicodeDecodeError) as err:
        raise ripplekv.UserError(f"cannot read the text file {args.text} ({getattr(err, 'strerror', None) or err}); "
                                 "pass a readable UTF-8 text file") from None
    model, tokenizer = ripplekv.load_model()
    answers = ripplekv.generate(model, tokenizer, context, args.question, methods=args.methods.split(","),
                                budgets=args.budget or [64], max_new_tokens=16)
    for answer in answers:
        where = "full" if answer.budget is None else f"{answer.method}@{answer.budget}"
        print(f"{where:>16}  kept {answer.kept_entries:>6}  kl {answer.kl:.4f}  {answer.text!r}")


if __name__ == "__main__":
    try:
        main()
    except ripplekv.UserError as err:  # your mistake, not a bug: its message says what to do
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
