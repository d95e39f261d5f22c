"""Turn what a user names on the command line into parameters to estimate, without downloading weights.

``resolve_model(spec)`` accepts, in this order:

1. a bare parameter count: ``65783042``, ``65,783,042``, ``125m``, ``1.1B``, ``7b``, ``7e9``
   (anything that looks like a number is a count, never a Hub id; see :func:`parse_param_count`);
2. a preset name or its Hub id (``distilbert-base-cased``, ``meta-llama/Llama-2-7b-hf``, ...):
   the model is built from the configuration values in :data:`PRESETS`;
3. a local ``config.json`` or a folder that holds one;
4. a Hugging Face Hub id, whose ``config.json`` is fetched (or read from the local cache).

Models are built with transformers on the ``meta`` device: shapes without memory, no weights
downloaded. What a config asks for is bounded first (:data:`MAX_CONFIG_LAYERS`,
:data:`MAX_CONFIG_PARAMS`, :data:`MAX_CONFIG_MODULES`; its sizes must be whole numbers), since
each module costs Python time and memory even on ``meta``: a one-line ``ValueError`` names the
field. A preset, a config or a Hub id needs transformers; a bare count does not. No
model's own Python code is ever run: configs are read with ``trust_remote_code=False`` and
stdin is not read (transformers would otherwise ask there whether to run a folder's code); a
config that only custom code can build is a ``ValueError`` that says so.

A bare count has no shapes. It is estimated as **one 1-D tensor of N elements**: exact for
element-wise states (AdamW: 8 B/param); for block-quantized states it ignores each tensor's
rounding up to whole blocks and the dense fallback for small tensors, so it is a little low
(8-bit / 4-bit: DistilBERT 0.3% / 0.6%, TinyLlama 0.03% / 0.06%, Llama-2-7B < 0.001%). A
factored state (Adafactor) depends on the matrix shapes, so it has no estimate from a count:
``ModelSource.exact_shapes`` is False and the CLI prints ``n/a``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal, localcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a model is built: naming one (locate_model) needs no torch
    import torch

__all__ = [
    "MAX_CONFIG_LAYERS",
    "MAX_CONFIG_MODULES",
    "MAX_CONFIG_PARAMS",
    "MAX_PARAM_COUNT",
    "PRESETS",
    "ModelSource",
    "Preset",
    "hub_endpoint",
    "hub_offline",
    "hub_unreachable",
    "parse_param_count",
    "locate_model",
    "resolve_model",
    "shape_dependent",
]

# Seconds to wait for the Hub before saying it is unreachable (huggingface_hub's own default
# is 10 s per try with 5 retries: ~24 s with no network).
HUB_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Preset:
    """A model known without a download: the values of its published ``config.json``.

    Only values that change parameter shapes (and a few that transformers would otherwise
    complain about) are listed; the rest keep the config class's defaults. ``params`` is the
    number of parameter elements the built model has (checked by the tests).
    """

    hub_id: str
    model_class: str
    config_class: str
    config: dict[str, Any]
    params: int
    aliases: tuple[str, ...] = ()


_SEQ_CLS = {"num_labels": 2}

# Encoders are built for sequence classification with 2 labels (fine-tuning, as in the
# DistilBERT lesson); decoders as causal LMs; T5 as a seq2seq LM.
PRESETS: dict[str, Preset] = {
    "distilbert-base-cased": Preset(
        "distilbert/distilbert-base-cased", "DistilBertForSequenceClassification", "DistilBertConfig",
        {"vocab_size": 28996, "dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072,
         "max_position_embeddings": 512, **_SEQ_CLS},
        65_783_042,
    ),
    "bert-base-uncased": Preset(
        "google-bert/bert-base-uncased", "BertForSequenceClassification", "BertConfig",
        {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
         "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2, **_SEQ_CLS},
        109_483_778,
    ),
    "roberta-base": Preset(
        "FacebookAI/roberta-base", "RobertaForSequenceClassification", "RobertaConfig",
        {"vocab_size": 50265, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
         "intermediate_size": 3072, "max_position_embeddings": 514, "type_vocab_size": 1,
         "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, **_SEQ_CLS},
        124_647_170,
    ),
    "gpt2": Preset(
        "openai-community/gpt2", "GPT2LMHeadModel", "GPT2Config",
        {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12},
        124_439_808,
    ),
    "gpt2-medium": Preset(
        "openai-community/gpt2-medium", "GPT2LMHeadModel", "GPT2Config",
        {"vocab_size": 50257, "n_positions": 1024, "n_embd": 1024, "n_layer": 24, "n_head": 16},
        354_823_168,
    ),
    "t5-base": Preset(
        "google-t5/t5-base", "T5ForConditionalGeneration", "T5Config",
        {"vocab_size": 32128, "d_model": 768, "d_kv": 64, "d_ff": 3072, "num_layers": 12,
         "num_decoder_layers": 12, "num_heads": 12, "feed_forward_proj": "relu", "tie_word_embeddings": True},
        222_903_552,
    ),
    "qwen2.5-0.5b": Preset(
        "Qwen/Qwen2.5-0.5B", "Qwen2ForCausalLM", "Qwen2Config",
        {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
         "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True},
        494_032_768,
    ),
    "tinyllama-1.1b": Preset(
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "LlamaForCausalLM", "LlamaConfig",
        {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
         "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
        1_100_048_384,
        aliases=("tinyllama",),
    ),
    "phi-2": Preset(
        "microsoft/phi-2", "PhiForCausalLM", "PhiConfig",
        {"vocab_size": 51200, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
         "partial_rotary_factor": 0.4, "layer_norm_eps": 1e-5, "tie_word_embeddings": False},
        2_779_683_840,
    ),
    "llama-2-7b": Preset(
        "meta-llama/Llama-2-7b-hf", "LlamaForCausalLM", "LlamaConfig",
        {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
        6_738_415_616,
    ),
    "mistral-7b": Preset(
        "mistralai/Mistral-7B-v0.1", "MistralForCausalLM", "MistralConfig",
        {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
         "sliding_window": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
        7_241_732_096,
    ),
    "llama-3-8b": Preset(
        "meta-llama/Meta-Llama-3-8B", "LlamaForCausalLM", "LlamaConfig",
        {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "tie_word_embeddings": False},
        8_030_261_248,
    ),
    "llama-2-13b": Preset(
        "meta-llama/Llama-2-13b-hf", "LlamaForCausalLM", "LlamaConfig",
        {"vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
         "num_attention_heads": 40, "num_key_value_heads": 40, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
        13_015_864_320,
    ),
}


def _preset_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for name, preset in PRESETS.items():
        for key in (name, preset.hub_id, preset.hub_id.split("/")[-1], *preset.aliases):
            index[key.lower()] = name
    return index


_PRESET_INDEX = _preset_index()


@dataclass
class ModelSource:
    """What to estimate: ``params`` goes to :func:`leanopt.estimate` / :func:`leanopt.training_memory`.

    ``params`` is a model on the meta device, or (for a bare count) a list with one 1-D meta
    tensor. ``tensors`` is None and ``exact_shapes`` False for a bare count.
    """

    name: str
    description: str
    params: Any
    param_count: int
    tensors: int | None
    exact_shapes: bool


# ---- bare counts ---------------------------------------------------------------------------
# The largest count: its fp32 state must fit torch's int64 byte sizes (meta tensors included),
# with room to spare. 10**18 is six orders of magnitude above any model trained so far.
MAX_PARAM_COUNT = 10**18

# Anything made of digits, separators, a decimal point, an exponent and a suffix is meant as a
# count, and is never looked up on the Hub (whose ids have letters or a slash).
_NUMERIC = re.compile(r"^[+-]?[\d.,_]*\d[\d.,_]*(?:e[+-]?\d*)?[kmbt]?$", re.IGNORECASE)
# Commas only as thousands separators (1,234,567); underscores between digits, as in Python.
_COUNT = re.compile(
    r"^(?P<sign>[+-]?)(?P<int>\d{1,3}(?:,\d{3})+|\d+(?:_\d+)*)(?:\.(?P<frac>\d+))?"
    r"(?:e(?P<exp>[+-]?\d+))?(?P<suffix>[kmbt]?)$",
    re.IGNORECASE,
)
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_param_count(text: str) -> int | None:
    """``"7b"`` -> 7_000_000_000, ``"65,783,042"`` -> 65783042, ``"1e12"`` -> 10**12; None if
    ``text`` is not a number (a preset, a path, a Hub id).

    A number must be a whole count from 1 to :data:`MAX_PARAM_COUNT`, else ``ValueError``:
    ``"0"``, ``"1.5"``, ``"3e18"``, and ``"1,2,3"`` (commas only separate thousands:
    ``1,234,567``) are errors, not model names. Suffixes k, m, b, t are 10^3, 10^6, 10^9,
    10^12; a decimal point or an exponent is fine when the result is whole (``1.1b``, ``7e9``).
    """
    text = text.strip()
    if not _NUMERIC.match(text):
        return None
    shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
    m = _COUNT.match(text)
    if m is None:
        hint = " (commas only separate thousands: 65,783,042)" if "," in text else ""
        raise ValueError(f"{shown} is not a parameter count{hint}; examples: 65783042, 65,783,042, 125m, 1.1b, 7e9")
    number = m["int"].replace(",", "").replace("_", "") + (f".{m['frac']}" if m["frac"] else "")
    exp = m["exp"] or "0"
    exp_value = int(exp) if len(exp) <= 8 else (-1 if exp.startswith("-") else 1) * 10**8
    with localcontext() as ctx:  # exact: the digits times a power of ten
        ctx.prec, ctx.Emax, ctx.Emin = len(number) + 20, 10**9, -(10**9)
        value = Decimal(number).scaleb(exp_value) * _SUFFIX[m["suffix"].lower()]
    if value == 0 or m["sign"] == "-":
        raise ValueError(f"{shown}: a parameter count must be > 0")
    if value > MAX_PARAM_COUNT:
        raise ValueError(f"{shown}: too large a parameter count (at most 1e18)")
    if value != value.to_integral_value():
        raise ValueError(f"{shown}: a parameter count must be a whole number")
    return int(value)


# ---- transformers --------------------------------------------------------------------------
def _needs_transformers(what: str) -> None:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"{what} needs transformers (pip install 'leanopt[transformers]'); "
                         "a bare parameter count such as 7b works without it")


def _transformers(what: str) -> Any:
    _needs_transformers(what)
    import transformers

    return transformers


@contextlib.contextmanager
def _no_stdin() -> Iterator[None]:
    """transformers asks on stdin whether to run a folder's code; nothing here ever answers."""
    saved = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = saved


# ---- what a config may ask for --------------------------------------------------------------
# A config is a few hundred bytes of JSON from anywhere (a download, a Hub repo): what it asks
# for is bounded before anything is built. Each module transformers builds costs Python time and
# memory even on the meta device (~0.13 ms and ~4 KB here): 10^9 layers never finish.
#
# Layer counts: the deepest real transformers have a few hundred layers (Llama-3-405B: 126).
MAX_CONFIG_LAYERS = 10_000
# Parameters: 25x Llama-3-405B (405.9 B), 6x switch-c-2048 (1.57 T).
MAX_CONFIG_PARAMS = 10**13
# Modules, whatever field multiplies them (experts, labels' heads, sub-configs): switch-c-2048,
# the largest real count known here, builds 307,844 (2,048 experts per layer; 23 s, 1.3 GB).
MAX_CONFIG_MODULES = 500_000
# Classes: PretrainedConfig makes an id2label entry per label before any check of ours runs.
MAX_CONFIG_LABELS = 10**6
# Experts per layer: real ones have up to 2,048 (switch-c-2048); some models build a module per
# expert, so a million of them in one layer would take minutes to reach the module bound.
MAX_CONFIG_EXPERTS = 16_384
_EXPERT_FIELDS = frozenset({"num_experts", "num_local_experts", "n_routed_experts"})

# The fields that count layers, in the names transformers' configs use.
_LAYER_FIELDS = frozenset({
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "num_encoder_layers",
    "encoder_layers", "decoder_layers",
})
# Fields that are sizes or counts wherever they appear: a whole number > 0 (or null: derived);
# a layer count and head_dim may be 0 (GLM-5 Next's default head_dim: set from another field).
_SIZE_FIELDS = frozenset({
    "hidden_size", "n_embd", "dim", "d_model", "intermediate_size", "hidden_dim", "d_ff", "n_inner", "ffn_dim",
    "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size", "num_attention_heads", "n_head", "n_heads",
    "num_heads", "num_key_value_heads", "encoder_attention_heads", "decoder_attention_heads", "head_dim", "d_kv",
    "vocab_size", "max_position_embeddings", "n_positions", "num_labels", "num_experts", "num_local_experts",
    "n_routed_experts", "num_experts_per_tok",
})
_MAY_BE_ZERO = _LAYER_FIELDS | {"head_dim"}


def _check_config_values(values: Mapping[str, Any], what: str, prefix: str = "") -> None:
    """Every size, count and layer count in ``values`` (a config's JSON, or its ``to_dict()``,
    sub-configs included) is a whole number in range, or a list of them (per stage or layer:
    CvT's ``num_heads``, Gemma 3n's ``intermediate_size``): a one-line ``ValueError`` naming the
    field, not a ZeroDivisionError or a negative dimension from deep inside a model's code."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _check_config_values(value, what, f"{name}.")
        elif value is not None and (key in _LAYER_FIELDS or key in _SIZE_FIELDS):
            for item in value if isinstance(value, (list, tuple)) else [value]:
                _check_count(key, name, item, what)


def _check_count(key: str, name: str, value: Any, what: str) -> None:
    if isinstance(value, float) and value.is_integer():  # 1200.0: a default of transformers' own (musicflamingo)
        value = int(value)
    least = 0 if key in _MAY_BE_ZERO else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        shown = json.dumps(value)[:40] if isinstance(value, (int, float, str)) else type(value).__name__
        raise ValueError(f"{what}: {name} is {shown}; it must be a whole number {'>= 0' if least == 0 else '> 0'}")
    if key in _LAYER_FIELDS and value > MAX_CONFIG_LAYERS:
        raise ValueError(f"{what}: {name} is {value:,}; leanopt builds at most {MAX_CONFIG_LAYERS:,} layers "
                         "(the deepest real models have a few hundred)")
    if key == "num_labels" and value > MAX_CONFIG_LABELS:
        raise ValueError(f"{what}: {name} is {value:,}; leanopt builds at most {MAX_CONFIG_LABELS:,} labels")
    if key in _EXPERT_FIELDS and value > MAX_CONFIG_EXPERTS:
        raise ValueError(f"{what}: {name} is {value:,}; leanopt builds at most {MAX_CONFIG_EXPERTS:,} experts "
                         "per layer (the most in a real model: 2,048)")


def _is_config(value: Any) -> bool:
    """A (sub-)config: text_config, vision_config, encoder, decoder, ..."""
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _sizes(config: Any, prefix: str = "") -> list[str]:
    """``["num_hidden_layers=200", "hidden_size=65536", ...]``: the config's sizes, for a message."""
    out = []
    for key, value in vars(config).items():
        if _is_config(value):
            out += _sizes(value, f"{prefix}{key}.")
        elif (key in _LAYER_FIELDS or key in _SIZE_FIELDS) and isinstance(value, int) and not isinstance(value, bool):
            out.append(f"{prefix}{key}={value}")
    return out


class _TooManyModules(Exception):
    pass


class _Refused(ValueError):
    """A config asks for more than leanopt builds: no other model class would change that."""


def _guarded_build(build: Callable[[Any], torch.nn.Module], config: Any) -> torch.nn.Module:
    import torch
    """``build(config)`` on the meta device, stopped once it has made :data:`MAX_CONFIG_MODULES`
    modules (whatever field of the config multiplies them)."""
    from torch.nn.modules.module import register_module_module_registration_hook

    me, made = threading.get_ident(), [0]

    def count(module: Any, name: str, submodule: Any) -> None:
        if threading.get_ident() == me:  # the hook is global: other threads' modules are theirs
            made[0] += 1
            if made[0] > MAX_CONFIG_MODULES:
                raise _TooManyModules

    handle = register_module_module_registration_hook(count)
    try:
        # The default device, not from_pretrained: shapes only, no weights read or allocated,
        # and the config's dtype is not applied (precision is the estimate's business).
        with torch.device("meta"), _no_stdin():
            return build(config)
    finally:
        handle.remove()


def _layer_paths(config: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str, int]]:
    """(sub-config path, field, count) of every layer count set in ``config`` and its sub-configs."""
    out = []
    for key, value in vars(config).items():
        if _is_config(value):
            out += _layer_paths(value, (*path, key))
        elif key in _LAYER_FIELDS and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out.append((path, key, value))
    return out


def _with_layers(config: Any, layers: dict[tuple[tuple[str, ...], str], int]) -> Any:
    probe = copy.deepcopy(config)
    for (path, key), value in layers.items():
        target = probe
        for part in path:
            target = getattr(target, part)
        setattr(target, key, value)
    return probe


def _probe(build: Callable[[Any], torch.nn.Module], config: Any) -> tuple[int, int] | None:
    """The (parameters, modules) ``build(config)`` would make, from models of one and two layers
    (their layers are alike: what a second layer adds, every further one adds), without
    building them all.

    None when there is nothing to scale (no layer count, or one layer each) or when a reduced
    config does not build (the full build then counts, within the bound on modules).
    """
    fields = {(path, key): n for path, key, n in _layer_paths(config)}
    if not fields or all(n == 1 for n in fields.values()):
        return None

    def made(layers: dict[tuple[tuple[str, ...], str], int]) -> tuple[int, int]:
        model = _guarded_build(build, _with_layers(config, layers))
        return sum(p.numel() for p in model.parameters()), sum(1 for _ in model.modules())

    try:
        ones = dict.fromkeys(fields, 1)
        base = made(ones)
        params, modules = base
        for field, n in fields.items():
            more = made({**ones, field: 2})
            params += (n - 1) * (more[0] - base[0])
            modules += (n - 1) * (more[1] - base[1])
    except _TooManyModules:  # one or two layers already make too many: so would the rest
        raise
    except Exception:  # noqa: BLE001 - a config that only builds whole: counted after the build
        return None
    return params, modules


def _refuse_params(n: int, config: Any, what: str, about: str = "") -> None:
    if n > MAX_CONFIG_PARAMS:
        raise _Refused(
            f"{what}: the config asks for {about}{n:.3g} parameters ({', '.join(_sizes(config)) or 'its sizes'}); "
            f"leanopt builds at most {MAX_CONFIG_PARAMS:.0e} (Llama-3-405B has 4.06e+11): check its sizes"
        )


def _too_many_modules(config: Any, what: str) -> ValueError:
    return _Refused(
        f"{what}: the config asks for more than {MAX_CONFIG_MODULES:,} modules "
        f"({', '.join(_sizes(config)) or 'its sizes'}); the largest real models build ~300,000: check its sizes"
    )


# What an installed peer logs while transformers imports it for a model leanopt builds (torchao,
# imported by the modeling code: a "Failed to load ... .so" per extension built for another
# Python, and torch's _pytree deprecation notes on its enums) is not the user's business: quiet
# while leanopt builds, as it was before. A user who imports transformers' models first sees it.
_PEER_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet_peer_imports() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _PEER_IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.ERROR))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _build_on_meta(config: Any, class_name: str | None, what: str) -> torch.nn.Module:
    with _quiet_peer_imports():
        return _build_quietly(config, class_name, what)


def _build_quietly(config: Any, class_name: str | None, what: str) -> torch.nn.Module:
    transformers = _transformers(what)
    _check_config_values(config.to_dict(), what)
    candidates: list[Any] = []
    if class_name:
        # Only a model class of transformers itself: a name from a config must not pick any
        # other callable of the package, nor anything a checkpoint's own code defines.
        try:
            cls = getattr(transformers, class_name, None)
        except Exception:  # a lazy import that fails
            cls = None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            candidates.append(cls)
    candidates += [
        lambda c: transformers.AutoModelForCausalLM.from_config(c, trust_remote_code=False),
        lambda c: transformers.AutoModel.from_config(c, trust_remote_code=False),
    ]
    errors = []
    for build in candidates:
        try:
            expected = _probe(build, config)
            if expected is not None:
                _refuse_params(expected[0], config, what, "about ")
                if expected[1] > MAX_CONFIG_MODULES:
                    raise _TooManyModules
            model = _guarded_build(build, config)
        except _TooManyModules:
            raise _too_many_modules(config, what) from None
        except _Refused:
            raise
        # Whatever a config's values make a model's code raise (a RuntimeError for a dimension
        # no check here knows, a ZeroDivisionError): the config's fault, said in one line.
        except Exception as err:  # noqa: BLE001
            errors.append(_first_line(err))
        else:
            _refuse_params(sum(p.numel() for p in model.parameters()), config, what)
            return model
    raise ValueError(f"{what}: transformers cannot build a model from this config ({'; '.join(errors)})")


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())  # a StrictDataclassFieldValidationError spans lines
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def _from_preset(name: str) -> torch.nn.Module:
    preset = PRESETS[name]
    transformers = _transformers(f"the preset {name!r}")
    config = getattr(transformers, preset.config_class)(**preset.config)
    return _build_on_meta(config, preset.model_class, f"the preset {name!r}")


def _from_config_path(path: Path) -> tuple[torch.nn.Module, str]:
    transformers = _transformers(f"the config {str(path)!r}")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no config.json there")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: not a transformers config ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: not a transformers config (a JSON {type(raw).__name__}, not an object)")
    custom_code = (
        f"{file}: this model needs custom code (its config's auto_map names Python files); "
        "leanopt never runs a model's own code (trust_remote_code=False)"
    )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # A known model_type builds transformers' own class even with an auto_map next to it.
    model_type = raw.get("model_type")
    if raw.get("auto_map") and not (isinstance(model_type, str) and model_type in CONFIG_MAPPING):
        raise ValueError(custom_code)
    _check_config_values(raw, str(file))  # before transformers reads it (id2label per label, head sizes)
    try:
        with _no_stdin():
            config = transformers.AutoConfig.from_pretrained(
                str(file.parent) if file.name == "config.json" else str(file), trust_remote_code=False
            )
    except Exception as err:  # noqa: BLE001 - e.g. StrictDataclassFieldValidationError for a field's type
        if "trust_remote_code" in str(err):
            raise ValueError(custom_code) from None
        raise ValueError(f"{file}: not a transformers config ({_first_line(err)})") from None
    architectures = raw.get("architectures")
    arch = architectures[0] if isinstance(architectures, list) and architectures and isinstance(architectures[0], str) else None
    return _build_on_meta(config, arch, str(file)), arch or type(config).__name__


# ---- the Hub, as huggingface_hub sees it ---------------------------------------------------------
# huggingface_hub's own reading (constants.py: ``_is_true`` and ``HF_HUB_OFFLINE``): the value of
# HF_HUB_OFFLINE, or of TRANSFORMERS_OFFLINE when that is unset or empty, upper-cased, is one
# of these. Read the same way here so leanopt never tries the network the Hub library refuses
# (nor calls offline what it would use).
_HUB_TRUE = frozenset({"1", "ON", "YES", "TRUE"})
_HUB_DEFAULT_ENDPOINT = "https://huggingface.co"


def hub_offline() -> bool:
    """Whether the Hugging Face Hub is switched off (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return value is not None and value.upper() in _HUB_TRUE


def hub_endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT`` (a mirror, with its own scheme and port) or huggingface.co."""
    return os.getenv("HF_ENDPOINT", _HUB_DEFAULT_ENDPOINT).rstrip("/")


def hub_unreachable(timeout: float = HUB_TIMEOUT_S) -> str | None:
    """Why the Hub (:func:`hub_endpoint`) cannot be reached, or None when it answers.

    One short HEAD request through huggingface_hub's own session (its proxies and headers), to
    the endpoint's own scheme and port: any answer, an error status included, means reachable.
    Offline (:func:`hub_offline`), no connection is opened at all.
    """
    if hub_offline():
        return "offline (HF_HUB_OFFLINE)"
    from huggingface_hub.utils import get_session

    try:
        get_session().head(hub_endpoint(), timeout=timeout)
    except Exception as err:  # noqa: BLE001 - whatever the HTTP stack raises: not reachable
        return type(err).__name__
    return None


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def nearest_presets(name: str, n: int = 3) -> list[str]:
    """The presets whose names (any of their aliases) are nearest ``name``: those that contain it
    or that it contains, and ``difflib``'s close matches (ratio >= 0.6), nearest first, at most
    ``n``, each once."""
    import difflib

    key = name.strip().lower()
    out: list[str] = []
    aliases = [a for a in _PRESET_INDEX if "/" not in a]
    near = {a for a in aliases if key and (key in a or a in key)} | set(difflib.get_close_matches(key, aliases, n=n, cutoff=0.6))
    for alias in sorted(near, key=lambda a: (-difflib.SequenceMatcher(None, key, a).ratio(), a)):
        preset = _PRESET_INDEX[alias]
        if preset not in out:
            out.append(preset)
    return out[:n]


def _hub_config(repo_id: str) -> Path:
    """The Hub's ``config.json`` of ``repo_id``: from the local cache, else downloaded."""
    _needs_transformers(f"{repo_id!r} (not a preset, a local path or a count, so a Hub id)")
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    what = f"{repo_id!r} is not a preset, a local path or a parameter count"
    # The cache alone: hf_hub_download(..., local_files_only=True) builds its request headers
    # all the same, and huggingface_hub 2.4 fetches an agent registry from the Hub for them
    # (up to 3 s) unless HF_HUB_OFFLINE was set before it was imported.
    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # not a valid repo id: decided below
        cached = None
    file = cached if isinstance(cached, str) else None
    if file is None:
        near = nearest_presets(repo_id)
        if near and "/" not in repo_id:
            # A bare name near a preset is a typo far more often than a Hub id: say so before the network.
            raise ValueError(f"{repo_id!r} is not a preset: did you mean {_either(near)}? (presets: "
                             f"{', '.join(PRESETS)}; a Hub model by its full id, organisation/name)")  # fmt: skip
        if hub_offline():
            raise ValueError(f"{what}, and the Hub is offline (HF_HUB_OFFLINE) with no cached config for it")
        # One short request first: hf_hub_download retries unreachable hosts for ~24 s.
        why = hub_unreachable()
        if why is not None:
            raise ValueError(f"{what}, and the Hub ({hub_endpoint()}) cannot be reached ({why})")
        try:
            file = hf_hub_download(repo_id, "config.json", etag_timeout=HUB_TIMEOUT_S, endpoint=hub_endpoint())
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"{what}, and the Hub has no config for it ({first})") from None
    return Path(file)


# ---- entry point -----------------------------------------------------------------------------
def _summary(model: torch.nn.Module) -> tuple[int, int]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in trainable), len(trainable)


def locate_model(spec: str) -> tuple[str, Any]:
    """What ``spec`` names, found without importing torch or transformers (the command line checks
    a model name before it pays for them): ``("count", n)``, ``("preset", name)``, ``("config",
    path)`` or ``("hub", path of its cached or downloaded config.json)``.

    Raises ``ValueError`` with a one-line message when ``spec`` names nothing usable.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("the model name is empty: give a preset, a config.json or folder, a Hub id or a parameter count")
    count = parse_param_count(spec)
    if count is not None:
        return "count", count
    key = _PRESET_INDEX.get(spec.strip().lower())
    if key is not None:
        _needs_transformers(f"the preset {key!r}")
        return "preset", key
    if Path(spec).exists():
        _needs_transformers(f"the config {spec!r}")
        if Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
            raise ValueError(f"{spec}: no config.json there")
        return "config", Path(spec)
    if spec.endswith(".json") or spec.startswith((".", "/", "~")):
        raise ValueError(f"{spec}: no such file or folder")
    return "hub", _hub_config(spec)


def resolve_model(spec: str) -> ModelSource:
    """A preset name, Hub id, config path or parameter count -> a :class:`ModelSource`.

    Raises ``ValueError`` with a one-line message when ``spec`` names nothing usable.
    """
    import torch

    kind, found = locate_model(spec)
    if kind == "count":
        return ModelSource(
            spec, f"{found:,} parameters (a bare count: one 1-D tensor, no shapes)",
            [torch.empty(found, device="meta", requires_grad=True)], found, None, exact_shapes=False,
        )
    if kind == "preset":
        preset = PRESETS[found]
        model = _from_preset(found)
        description = f"{preset.model_class}, preset with the config of {preset.hub_id}"
    else:
        model, arch = _from_config_path(found)
        description = f"{arch} from {spec}" if kind == "config" else f"{arch} from the Hub config of {spec}"
    n, tensors = _summary(model)
    return ModelSource(spec, description, model, n, tensors, exact_shapes=True)



def shape_dependent(optimizer: str | type, **optimizer_kwargs: Any) -> bool:
    """Whether ``optimizer``'s state size depends on tensor shapes, not only on element counts.

    True for factored states (Adafactor) and for optimizers that treat matrices apart (Muon, which
    refuses a 1-D tensor where it expects a matrix): a bare parameter count cannot give their size.
    """
    import torch

    from leanopt.memory.estimate import estimate

    try:
        flat = estimate([torch.empty(4096 * 4096, device="meta")], optimizer, **optimizer_kwargs)
    except ValueError:  # the optimizer refuses a lone 1-D tensor: its state is not a function of counts
        return True
    square = estimate([torch.empty(4096, 4096, device="meta")], optimizer, **optimizer_kwargs)
    return flat.bytes != square.bytes
