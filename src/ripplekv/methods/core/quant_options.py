"""A spec's quantizer options, and the method they make (`methods.core.quantized`).

`quant=kivi` (KIVI's per-channel keys) or `quant=token` (FlexGen's per-token keys) names the scheme; the `kivi`
preset is the full cache with `quant=kivi`. Its options: `bits=N` (2, 4 or 8) stores keys and values at N bits;
`kbits=`, `vbits=` (2, 4, 8 or 16; 16: that tensor at full precision) set each alone, the other keeping KIVI's
2 (KVTuner's keys-more-than-values baseline is `kivi:kbits=4:vbits=2`); `bits=profile` takes each layer's bits
from the sensitivity profile of an allocation file (`methods.core.bit_allocation`: the spec's `allocation=`, else
the command's --allocation, found as for `ripplekv`), with `avgbits=` (default 4) when the method also evicts;
`group=` and `residual=` as KIVI's. Key-channel pruning (`think=`, `methods.core.key_channels`) goes in the same
wrapper, with or without a quantizer: it spends the same bytes another way; the `think` preset is the full cache
with pruned keys, as `kivi` is with quantized entries.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ripplekv.engine.quantize import BITS, FULL_PRECISION, QuantSpec
from ripplekv.errors import UserError
from ripplekv.methods.core import key_channels
from ripplekv.methods.core.bit_allocation import DEFAULT_AVERAGE_BITS, BitProfile, read_sensitivity
from ripplekv.methods.core.quantized import Quantized
from ripplekv.methods.core.thresholded import OPTION as THRESHOLD

QUANT_OPTIONS = ("bits", "kbits", "vbits", "avgbits", "group", "residual")  # `quant=` names the scheme
# quant= -> how keys are grouped: KIVI's per channel, or FlexGen's per token (values are per token in both)
SCHEMES = {"kivi": "channel", "token": "token"}
STORED_ALONE = ("kivi", "think")  # presets that are the full cache stored another way
FULL_PRECISION_STORAGE = QuantSpec(bits=FULL_PRECISION, residual=0)  # key channels pruned, nothing quantized
PROFILE = "profile"
PROFILE_FILE = "allocation"  # the file `bits=profile` reads its sensitivity from
SPEC_FIELDS = {"bits": "bits", "kbits": "key_bits", "vbits": "value_bits", "group": "group", "residual": "residual"}
_DEFAULT = QuantSpec()
QUANT_HELP = (f"quantizer options (kivi, or METHOD:quant=kivi|token): bits={_DEFAULT.bits} (2/4/8, keys and values); "
              f"kbits=, vbits= (2/4/8/{FULL_PRECISION}, each alone; {FULL_PRECISION}: full precision); bits=profile "
              f"(per layer from the allocation's sensitivity; avgbits={DEFAULT_AVERAGE_BITS:g} when the method also "
              f"evicts); group={_DEFAULT.group}; residual={_DEFAULT.residual}")


def reads_profile(given: dict) -> bool:
    """Does a parsed spec take its bits from a profile (and so read an allocation file)?"""
    return str(given.get("bits", "")).strip() == PROFILE


def _number(text: str, key: str, spec: str, kind=int):
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UserError(f"method spec {spec!r}: option {key} must be {what}, got {text!r}") from None


def _quant_spec(scheme: str, own: dict, spec: str) -> QuantSpec:
    """The scheme with its options checked: bits, or kbits/vbits, never both; not 16 bits for both tensors."""
    if "bits" in own and {"kbits", "vbits"} & set(own):
        raise UserError(f"method spec {spec!r}: give bits (keys and values) or kbits/vbits, not both")
    numbers = {SPEC_FIELDS[key]: _number(value, key, spec) for key, value in own.items() if key in SPEC_FIELDS}
    for key in ("bits", "kbits", "vbits"):  # checked here so the message names the spec's own option and choices
        allowed = [b for b in BITS if key != "bits" or b != FULL_PRECISION]  # both tensors at 16 bits: no quantizer
        if key in own and numbers[SPEC_FIELDS[key]] not in allowed:
            raise UserError(f"method spec {spec!r}: option {key} must be one of {', '.join(map(str, allowed))}, "
                            f"got {own[key]}")
    try:
        quantizer = QuantSpec(key_axis=SCHEMES[scheme], **numbers)
    except UserError as err:
        raise UserError(f"method spec {spec!r}: {err}") from None
    if quantizer.bits == FULL_PRECISION:
        raise UserError(f"method spec {spec!r}: keys and values at {FULL_PRECISION} bits is no quantizer; drop quant "
                        "(or the kivi preset) for full precision")
    return quantizer


def quantized_method(name: str, given: dict, spec: str, shared: dict | None, build: Callable[[str], object],
                     takes_allocation: Callable[[str], bool]) -> Quantized | None:
    """A spec with a quantizer (`kivi`, `METHOD:quant=kivi:bits=4`): `build` makes the method without it (from
    its spec), wrapped; None for every other spec. Pops the quantizer's and the key channels' options from `given`."""
    scheme = given.pop("quant", None)
    channels = key_channels.parse(given, spec, preset=name == "think")
    if name == "think" and scheme is not None:
        raise UserError(f"method spec {spec!r}: think is key-channel pruning alone; write kivi:think=0.5 to quantize "
                        "the pruned cache too, or snapkv:think=0.5:quant=kivi to evict as well")
    if name == "kivi":
        if scheme is not None:
            raise UserError(f"method spec {spec!r}: kivi is the quantizer alone; write snapkv:quant=kivi:bits=4 "
                            "to compose it with an eviction method")
        scheme = "kivi"
    own = {key: given.pop(key) for key in QUANT_OPTIONS if key in given}
    if scheme is not None and scheme not in SCHEMES:
        raise UserError(f"method spec {spec!r}: quant must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme is None:
        if own:
            raise UserError(f"method spec {spec!r}: option {', '.join(own)} needs a quantizer: add quant=kivi "
                            "(or quant=token)")
        if channels is None:
            return None
    if THRESHOLD in given:
        raise UserError(f"method spec {spec!r}: threshold= keeps a number of entries that varies per prompt, and a "
                        "quantizer or key channels fit a method to B's bytes: use one or the other")
    inner_name = "full" if name in STORED_ALONE else name
    profile = reads_profile(own)
    if profile and {"kbits", "vbits"} & set(own):
        raise UserError(f"method spec {spec!r}: bits=profile sets keys and values alike; drop kbits/vbits")

    def inner_spec() -> str:
        return ":".join([inner_name, *(f"{k}={v}" for k, v in given.items())])

    own_file = None  # an allocation= in the spec that only the profile reads
    if profile and PROFILE_FILE in given:
        file = given.pop(PROFILE_FILE)
        if takes_allocation(inner_spec()):
            given[PROFILE_FILE] = file
        else:
            own_file = file
    if name == "kivi" and given:
        raise UserError(f"method spec {spec!r}: kivi takes only bits, kbits, vbits, group and residual (and "
                        f"allocation with bits=profile, think=; got {', '.join(given)})")
    if name == "think" and given:
        raise UserError(f"method spec {spec!r}: think takes only ratio and window (got {', '.join(given)})")
    inner = build(inner_spec())
    numbers = {key: value for key, value in own.items() if key != "avgbits"}
    if scheme is None:
        quantizer = FULL_PRECISION_STORAGE
    else:
        quantizer = _quant_spec(scheme, {**numbers, "bits": "2"} if profile else numbers, spec)
    bit_profile = None
    if "avgbits" in own and not (profile and not inner.is_full):
        raise UserError(f"method spec {spec!r}: avgbits sets the average bits of bits=profile on a method that evicts "
                        "(quantization alone spends the budget's bytes); drop it")
    if profile:
        average = _number(own.get("avgbits", str(DEFAULT_AVERAGE_BITS)), "avgbits", spec, float)
        if not 2 <= average <= FULL_PRECISION:
            raise UserError(f"method spec {spec!r}: avgbits must be between 2 and {FULL_PRECISION}, got {average!r}")
        file = own_file or given.get(PROFILE_FILE) or (shared or {}).get(PROFILE_FILE)
        if file is None:
            raise UserError(f"method spec {spec!r}: bits=profile reads each layer's sensitivity from an allocation "
                            "file and none was given: run `ripplekv profile` and `ripplekv allocate`, then pass "
                            "its CSV as {allocation} (or allocation=FILE in the spec)", "allocation")
        bit_profile = BitProfile(str(file), read_sensitivity(file), None if inner.is_full else average)
    label = name + inner.label[len(inner_name):] + (f":quant={scheme}" if name != "kivi" and scheme else "")
    shown = {**own, **({PROFILE_FILE: Path(own_file).name} if own_file else {})}
    if "avgbits" in shown:
        shown["avgbits"] = _text(bit_profile.average_bits)
    label += "".join(f":{key}={_canonical(key, shown[key])}" for key in sorted(shown))
    if channels is not None:
        label += channels.label(preset=name == "think")
    return Quantized(label, name, inner, quantizer, bit_profile, channels)


def _text(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else repr(float(number))


def _canonical(key: str, value: str) -> str:
    """One spelling per value in a label: bits=04 is bits=4."""
    if key in SPEC_FIELDS and value != PROFILE:
        return str(int(value))
    return value
