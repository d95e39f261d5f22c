"""Turn what a user names on the command line into parameters to estimate, without downloading weights.

``resolve_model(spec)`` accepts, in this order:

1. a bare parameter count: ``65783042``, ``65,783,042``, ``125m``, ``1.1B``, ``7b``, ``7e9``
   (anything that looks like a number is a count, never a Hub id; see :func:`parse_param_count`);
2. a preset name or its Hub id (``distilbert-base-cased``, ``meta-llama/Llama-2-7b-hf``, ...):
   the model is built from the configuration values in :data:`PRESETS`;
3. a local ``config.json`` or a folder that holds one;
4. a Hugging Face Hub id, whose ``config.json`` is fetched (or read from the local cache).

Models are built with transformers on the ``meta`` device: shapes without memory, no weights
downloaded. A preset, a config or a Hub id needs transformers; a bare count does not. No
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
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any

import torch

__all__ = ["MAX_PARAM_COUNT", "PRESETS", "ModelSource", "Preset", "parse_param_count", "resolve_model", "shape_dependent"]

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
def _transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"{what} needs transformers (pip install 'leanopt[transformers]'); "
            "a bare parameter count such as 7b works without it"
        ) from None
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


def _build_on_meta(config: Any, class_name: str | None, what: str) -> torch.nn.Module:
    transformers = _transformers(what)
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
            # The default device, not from_pretrained: shapes only, no weights read or allocated,
            # and the config's dtype is not applied (precision is the estimate's business).
            with torch.device("meta"), _no_stdin():
                return build(config)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            errors.append(str(err).splitlines()[0] if str(err) else type(err).__name__)
    raise ValueError(f"{what}: transformers cannot build a model from this config ({'; '.join(errors)})")


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
    try:
        with _no_stdin():
            config = transformers.AutoConfig.from_pretrained(
                str(file.parent) if file.name == "config.json" else str(file), trust_remote_code=False
            )
    except (OSError, ValueError, KeyError) as err:
        if "trust_remote_code" in str(err):
            raise ValueError(custom_code) from None
        raise ValueError(f"{file}: not a transformers config ({str(err).splitlines()[0]})") from None
    architectures = raw.get("architectures")
    arch = architectures[0] if isinstance(architectures, list) and architectures and isinstance(architectures[0], str) else None
    return _build_on_meta(config, arch, str(file)), arch or type(config).__name__


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _from_hub(repo_id: str) -> tuple[torch.nn.Module, str]:
    _transformers(f"{repo_id!r} (not a preset, a local path or a count, so a Hub id)")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import get_session

    what = f"{repo_id!r} is not a preset, a local path or a parameter count"
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    try:
        file = hf_hub_download(repo_id, "config.json", local_files_only=True)
    except Exception:  # not cached, or not a valid repo id: decided below
        file = None
    if file is None:
        if offline:
            raise ValueError(f"{what}, and the Hub is offline (HF_HUB_OFFLINE) with no cached config for it")
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        try:
            # One short request first: hf_hub_download retries unreachable hosts for ~24 s.
            get_session().head(endpoint, timeout=HUB_TIMEOUT_S)
        except Exception as err:
            raise ValueError(f"{what}, and the Hub ({endpoint}) cannot be reached ({type(err).__name__})") from None
        try:
            file = hf_hub_download(repo_id, "config.json", etag_timeout=HUB_TIMEOUT_S)
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"{what}, and the Hub has no config for it ({first})") from None
    return _from_config_path(Path(file))


# ---- entry point -----------------------------------------------------------------------------
def _summary(model: torch.nn.Module) -> tuple[int, int]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in trainable), len(trainable)


def resolve_model(spec: str) -> ModelSource:
    """A preset name, Hub id, config path or parameter count -> a :class:`ModelSource`.

    Raises ``ValueError`` with a one-line message when ``spec`` names nothing usable.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("the model name is empty: give a preset, a config.json or folder, a Hub id or a parameter count")
    count = parse_param_count(spec)
    if count is not None:
        return ModelSource(
            spec, f"{count:,} parameters (a bare count: one 1-D tensor, no shapes)",
            [torch.empty(count, device="meta", requires_grad=True)], count, None, exact_shapes=False,
        )
    key = _PRESET_INDEX.get(spec.strip().lower())
    if key is not None:
        preset = PRESETS[key]
        model = _from_preset(key)
        description = f"{preset.model_class}, preset with the config of {preset.hub_id}"
    elif Path(spec).exists():
        model, arch = _from_config_path(Path(spec))
        description = f"{arch} from {spec}"
    elif spec.endswith(".json") or spec.startswith((".", "/", "~")):
        raise ValueError(f"{spec}: no such file or folder")
    else:
        model, arch = _from_hub(spec)
        description = f"{arch} from the Hub config of {spec}"
    n, tensors = _summary(model)
    return ModelSource(spec, description, model, n, tensors, exact_shapes=True)



def shape_dependent(optimizer: str | type, **optimizer_kwargs: Any) -> bool:
    """Whether ``optimizer``'s state size depends on tensor shapes, not only on element counts.

    True for factored states (Adafactor): a bare parameter count cannot give their size.
    """
    from leanopt.memory.estimate import estimate

    flat = estimate([torch.empty(4096 * 4096, device="meta")], optimizer, **optimizer_kwargs)
    square = estimate([torch.empty(4096, 4096, device="meta")], optimizer, **optimizer_kwargs)
    return flat.bytes != square.bytes
