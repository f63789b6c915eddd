"""Spec <-> transformers `BeamConfig` (config.json).

`spec_to_hf_config` writes the config.json of a checkpoint (`beamc init-weights`); `hf_config_to_spec` turns any
real checkpoint's config.json into a spec (`beamc import-hf`). Facts that BeamConfig does not carry (the SSMax
constants, rounding points, NVFP4 layout) keep the values transformers' Beam code hard-codes, which are the spec's
defaults.
"""
from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from beamc.errors import BeamcError
from beamc.spec.load import fmt_path, raise_problems, validation_problems
from beamc.spec.schema import ModelSpec


def spec_to_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The config.json transformers' `BeamConfig` reads for a checkpoint of this spec."""
    a, m = spec.attention, spec.mlp.moe
    cfg: dict[str, Any] = {
        "architectures": ["BeamForCausalLM"],
        "model_type": "beam",
        "dtype": spec.dtypes.activations,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.mlp.dense.d_ff,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "hidden_act": spec.mlp.dense.activation,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
        "rms_norm_eps": spec.norm.eps,
        "tie_word_embeddings": spec.logits.tie_word_embeddings,
        "attention_bias": a.bias,
        "attention_dropout": 0.0,
        "sliding_window": spec.effective_window,  # BeamConfig's window counts the current token
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": a.sliding.rope.theta},
            "full_attention": None,
        },
        "layer_types": spec.attention_types,
        "mlp_layer_types": spec.mlp_types,
        "moe_intermediate_size": m.d_ff,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.renormalize,
        "n_group": m.n_group,
        "topk_group": m.topk_group,
        "routed_scaling_factor": m.routed_scaling,
        "final_logit_softcapping": spec.logits.softcap,
        "use_cache": True,
    }
    if spec.dtypes.experts == "nvfp4":
        cfg["quantization_config"] = nvfp4_quant_config(spec)
    elif spec.dtypes.kv_cache == "fp8":  # ModelOpt's form for an FP8 KV cache alone (transformers skips it)
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": None, "kv_cache_quant_algo": "FP8"}
    return cfg


# Spec fields transformers' Beam hard-codes (no BeamConfig key): their values there, which are the schema's defaults.
HF_HARD_CODED = ("attention.full.q_scale", "norm.weight_form", "attention.qk_norm.weight_form", "residual.attn_n",
                 "residual.mlp_n", "mlp.moe.renorm_eps")


def hf_unexpressed(spec: ModelSpec) -> list[str]:
    """The spec's facts that config.json cannot carry: one line per field whose value differs from what
    transformers' Beam hard-codes. A checkpoint of such a spec is complete for beamc (which reads the spec), but
    transformers would run it with its own values."""
    out = []
    default = ModelSpec.model_construct()  # (the schema's defaults, which are transformers' values)
    for path in HF_HARD_CODED:
        have, want = spec, default
        for key in path.split("."):
            have, want = getattr(have, key), getattr(want, key)
        if have != want:
            show = (lambda v: v.model_dump() if hasattr(v, "model_dump") else v)  # noqa: E731
            out.append(f"{path} = {show(have)} (transformers' Beam hard-codes {show(want)})")
    if spec.attention.qk_norm.eps != spec.norm.eps:  # BeamConfig's one rms_norm_eps (written from norm.eps)
        out.append(f"attention.qk_norm.eps = {spec.attention.qk_norm.eps} (transformers' Beam uses rms_norm_eps, "
                   f"norm.eps = {spec.norm.eps}, for the q / k norms too)")
    return out


def nvfp4_quant_config(spec: ModelSpec) -> dict[str, Any]:
    """ModelOpt's quantization_config: only the routed experts are NVFP4, everything else is excluded."""
    exclude = ["lm_head", "model.embed_tokens"]
    for L, mlp in enumerate(spec.mlp_types):
        exclude.append(f"model.layers.{L}.self_attn*")
        exclude.append(f"model.layers.{L}.mlp.gate" if mlp == "sparse" else f"model.layers.{L}.mlp*")
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": spec.nvfp4.group_size,
        "kv_cache_quant_algo": "FP8" if spec.dtypes.kv_cache == "fp8" else None,
        "exclude_modules": exclude,
    }


# ---- config.json -> spec (`beamc import-hf`) ----

# BeamConfig's defaults (transformers 5.23, configuration_beam.py), written out so that importing needs no
# transformers; tests/test_import_hf.py checks them against BeamConfig(). layer_types, mlp_layer_types and
# rope_parameters default to None there and are then derived, as in `_layers` and `_rope_theta` below.
HF_DEFAULTS: dict[str, Any] = {
    "model_type": "beam", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 20480,
    "num_hidden_layers": 52, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "sliding_window": 512,
    "moe_intermediate_size": 2560, "num_experts_per_tok": 8, "num_experts": 256, "norm_topk_prob": True,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "final_logit_softcapping": 30.0,
    "layer_types": None, "mlp_layer_types": None,
}
_DEFAULT_THETA = 10000.0  # PreTrainedConfig.default_theta
_DEFAULT_FULL_EVERY, _DEFAULT_DENSE_FIRST = 6, 3  # BeamConfig.__post_init__'s rules
_STORED_DTYPES = ("activations", "embeddings", "attention_weights", "dense_mlp_weights", "norm_weights", "lm_head")

# spec key path -> the config.json key it comes from, to name the config key when the spec's checks fail
_CONFIG_KEY = {
    "name": "name (--name)", "num_layers": "num_hidden_layers",
    "layers.attention": "layer_types", "layers.full_every": "layer_types", "layers.last_is_full": "layer_types",
    "layers.mlp": "mlp_layer_types", "layers.dense_first": "mlp_layer_types",
    "attention.num_heads": "num_attention_heads", "attention.num_kv_heads": "num_key_value_heads",
    "attention.head_dim": "head_dim", "attention.bias": "attention_bias", "attention.qk_norm": "rms_norm_eps",
    "attention.sliding.window": "sliding_window", "attention.sliding.rope.rotary_dim": "head_dim",
    "attention.sliding.rope.theta": "rope_parameters.sliding_attention.rope_theta", "norm": "rms_norm_eps",
    "mlp.dense": "intermediate_size", "mlp.moe.num_experts": "num_experts", "mlp.moe.d_ff": "moe_intermediate_size",
    "mlp.moe.top_k": "num_experts_per_tok", "mlp.moe.n_group": "n_group", "mlp.moe.topk_group": "topk_group",
    "mlp.moe.renormalize": "norm_topk_prob", "mlp.moe.routed_scaling": "routed_scaling_factor",
    "logits.softcap": "final_logit_softcapping", "logits.tie_word_embeddings": "tie_word_embeddings",
    "dtypes.kv_cache": "quantization_config.kv_cache_quant_algo",
    "dtypes": "dtype",  # dtypes.experts too: only an unquantized experts dtype (from `dtype`) can be invalid
}


def _config_key(path: tuple) -> str:
    """The config key behind a spec path: the longest mapped prefix, keeping list indices (layer_types[3])."""
    for i in range(len(path), 0, -1):
        key = _CONFIG_KEY.get(fmt_path(path[:i]))
        if key is None and i == 1 and path[0] in HF_DEFAULTS:
            key = path[0]  # top-level keys with the same name in both (vocab_size, hidden_size, ...)
        if key is not None:
            return key + "".join(f"[{p}]" for p in path[i:] if isinstance(p, int))
    return f"(spec key {fmt_path(path)})"


def _attention_rule(types: list[Any]) -> dict[str, Any] | None:
    """The spec's rule (full_every, last_is_full) that yields exactly `types`, if there is one."""
    n = len(types)
    for every in range(1, n + 2):  # n + 1 with last_is_full false: all sliding
        for last in (True, False):
            rule = ["full_attention" if (i + 1) % every == 0 or (last and i == n - 1) else "sliding_attention"
                    for i in range(n)]
            if types == rule:
                return {"full_every": every, "last_is_full": last}
    return None


def _layers(c: dict[str, Any]) -> dict[str, Any]:
    """layer_types / mlp_layer_types as the spec's rules where they fit, explicit lists where they do not.

    A list whose length is not num_hidden_layers stays a list, so that the spec's length check reports it.
    """
    n, att, mlp = c["num_hidden_layers"], c["layer_types"], c["mlp_layer_types"]
    if att is None:  # BeamConfig's default: every sixth layer and the last are full attention
        out = {"full_every": _DEFAULT_FULL_EVERY, "last_is_full": True}
    else:
        fits = isinstance(att, list) and len(att) == n
        out = (fits and _attention_rule(att)) or {"attention": att}
    if mlp is None:  # BeamConfig's default: min(3, layers) dense layers first
        out["dense_first"] = min(_DEFAULT_DENSE_FIRST, n) if isinstance(n, int) else _DEFAULT_DENSE_FIRST
    elif isinstance(mlp, list) and isinstance(n, int) and mlp == ["dense"] * mlp.count("dense") + ["sparse"] * (
            n - mlp.count("dense")):
        out["dense_first"] = mlp.count("dense")
    else:
        out["mlp"] = mlp
    return out


def _rope_theta(c: dict[str, Any], cfg: dict[str, Any], reject) -> Any:
    """The sliding layers' RoPE base; beamc has plain RoPE on sliding layers and NoPE on full ones."""
    rp = c["rope_parameters"]
    if rp is None:
        rp = {"sliding_attention": {"rope_type": "default", "rope_theta": _DEFAULT_THETA}, "full_attention": None}
    if not isinstance(rp, dict) or not isinstance(rp.get("sliding_attention"), dict):
        reject("rope_parameters", "expected a mapping by layer type: {\"sliding_attention\": {\"rope_type\": "
               "\"default\", \"rope_theta\": 10000.0}, \"full_attention\": null}")
        return _DEFAULT_THETA
    sl = rp["sliding_attention"]
    if sl.get("rope_type", "default") != "default":
        reject("rope_parameters.sliding_attention.rope_type",
               f"is {sl['rope_type']!r}; beamc implements only 'default' RoPE (no scaling): set it to \"default\"")
    if sl.get("partial_rotary_factor", 1.0) != 1.0:
        reject("rope_parameters.sliding_attention.partial_rotary_factor",
               "Beam rotates the full head dim; remove it or set it to 1.0")
    if rp.get("full_attention") is not None:
        reject("rope_parameters.full_attention",
               "must be null: beamc's full-attention layers have no positional encoding (NoPE)")
    theta = sl.get("rope_theta")
    if theta is None:
        reject("rope_parameters.sliding_attention.rope_theta", "is missing; give the RoPE base, e.g. 10000.0")
    elif "rope_theta" in cfg and cfg["rope_theta"] != theta:
        # BeamConfig ignores a top-level rope_theta; a differing one means the author expected it to count
        reject("rope_theta", f"({cfg['rope_theta']}) differs from rope_parameters.sliding_attention.rope_theta "
               f"({theta}), which is what transformers uses; remove rope_theta or make them equal")
    return theta


def _quant_dtypes(q: Any, reject) -> tuple[str | None, str]:
    """(dtypes.experts, dtypes.kv_cache) from a ModelOpt quantization_config; experts None: not quantized (they are
    stored in the checkpoint's `dtype`, like every other weight)."""
    if q is None:
        return None, "bfloat16"
    if not isinstance(q, dict):
        reject("quantization_config", "expected a mapping (ModelOpt's quant_method/quant_algo/...) or null")
        return None, "bfloat16"
    experts, kv = None, "bfloat16"
    if q.get("quant_method", "modelopt") != "modelopt":
        reject("quantization_config.quant_method", f"is {q['quant_method']!r}; beamc reads ModelOpt checkpoints only")
    algo = q.get("quant_algo")
    if algo == "NVFP4":
        experts = "nvfp4"
        if q.get("group_size", 16) != 16:
            reject("quantization_config.group_size", f"is {q['group_size']}; NVFP4 uses groups of 16")
    elif algo is not None:
        reject("quantization_config.quant_algo",
               f"is {algo!r}; beamc reads NVFP4 routed experts or unquantized weights (quant_algo NVFP4 or null)")
    kv_algo = q.get("kv_cache_quant_algo")
    if kv_algo == "FP8":
        kv = "fp8"
    elif kv_algo is not None:
        reject("quantization_config.kv_cache_quant_algo", f"is {kv_algo!r}; beamc supports FP8 or null")
    return experts, kv


def _check_nvfp4_scope(spec: ModelSpec, q: dict[str, Any], reject) -> None:
    """beamc quantizes exactly the routed experts: everything else must be excluded, no expert may be."""
    patterns = q.get("exclude_modules", q.get("ignore")) or []
    excluded = lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)  # noqa: E731
    must = ["lm_head", "model.embed_tokens"]
    for L, mlp in enumerate(spec.mlp_types):
        must.append(f"model.layers.{L}.self_attn.q_proj")
        must.append(f"model.layers.{L}.mlp.gate" if mlp == "sparse" else f"model.layers.{L}.mlp.gate_proj")
    missing = [m for m in must if not excluded(m)]
    if missing:
        reject("quantization_config.exclude_modules", f"leaves {missing[0]} (and {len(missing) - 1} more) quantized; "
               "beamc supports NVFP4 for the routed experts only (exclude attention, dense MLPs, routers, "
               "embeddings and lm_head)")
    experts = [f"model.layers.{L}.mlp.experts.0.gate_proj" for L, m in enumerate(spec.mlp_types) if m == "sparse"]
    kept = [e for e in experts if excluded(e)]
    if kept:
        reject("quantization_config.exclude_modules", f"excludes the experts of {kept[0].rsplit('.mlp', 1)[0]}; "
               "beamc needs every routed expert in NVFP4")


def hf_config_to_spec(cfg: dict[str, Any], name: str, source: str = "config.json") -> ModelSpec:
    """The spec of a checkpoint whose config.json holds `cfg`; keys it lacks take BeamConfig's defaults.

    Anything beamc cannot compile raises one BeamcError naming each config key at fault and the fix.
    """
    c = {**HF_DEFAULTS, **cfg}
    problems: list[tuple[None, str]] = []

    def reject(key: str, message: str) -> None:
        problems.append((None, f"{key}: {message}"))

    if c["model_type"] != "beam":
        reject("model_type", f"is {c['model_type']!r}; beamc compiles Beam checkpoints only (model_type \"beam\")")
    if c["hidden_act"] != "silu":
        reject("hidden_act", f"is {c['hidden_act']!r}; Beam's MLPs are SwiGLU: set it to \"silu\"")
    if c["sliding_window"] is None:
        reject("sliding_window", "is null; beamc needs the sliding layers' window size (BeamConfig default: 512)")
    for key in ("n_group", "topk_group"):
        if c[key] is None:
            reject(key, "is null; beamc needs grouped routing: use n_group 1 and topk_group 1 for ungrouped")
    theta = _rope_theta(c, cfg, reject)
    experts, kv = _quant_dtypes(c.get("quantization_config"), reject)
    if problems:
        raise_problems(source, problems, "config")

    dtype = c.get("dtype") or c.get("torch_dtype") or "bfloat16"  # the checkpoint's storage (and compute) dtype
    data = {
        "name": name, "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
        "num_layers": c["num_hidden_layers"], "max_position_embeddings": c["max_position_embeddings"],
        "initializer_range": c["initializer_range"],
        "layers": _layers(c),
        "attention": {
            "num_heads": c["num_attention_heads"], "num_kv_heads": c["num_key_value_heads"],
            "head_dim": c["head_dim"], "bias": c["attention_bias"], "qk_norm": {"eps": c["rms_norm_eps"]},
            "sliding": {"window": c["sliding_window"], "rope": {"theta": theta, "rotary_dim": c["head_dim"]}},
        },
        "norm": {"eps": c["rms_norm_eps"]},
        "mlp": {
            "dense": {"d_ff": c["intermediate_size"]},
            "moe": {"num_experts": c["num_experts"], "d_ff": c["moe_intermediate_size"],
                    "top_k": c["num_experts_per_tok"], "n_group": c["n_group"], "topk_group": c["topk_group"],
                    "renormalize": c["norm_topk_prob"], "routed_scaling": c["routed_scaling_factor"]},
        },
        "logits": {"softcap": c["final_logit_softcapping"], "tie_word_embeddings": c["tie_word_embeddings"]},
        "dtypes": {**{k: dtype for k in _STORED_DTYPES}, "experts": experts or dtype, "kv_cache": kv},
    }
    try:
        spec = ModelSpec.model_validate(data)
    except ValidationError as err:
        raise_problems(source, [(None, f"{_config_key(p)}: {m}") for p, m in validation_problems(err)
                                # unquantized experts take `dtype`: their problem is the one reported for it
                                if not (experts is None and p == ("dtypes", "experts"))], "config")
    if experts == "nvfp4":
        _check_nvfp4_scope(spec, c["quantization_config"], reject)
        if problems:
            raise_problems(source, problems, "config")
    return spec


def config_mismatches(spec: ModelSpec, cfg: dict[str, Any], source: str = "config.json") -> list[str]:
    """Where a checkpoint's config.json disagrees with the spec: one line per config key, with both values.

    Every key `hf_config_to_spec` reads is compared, through the spec it makes: a config.json that import-hf rejects
    raises that BeamcError. The spec side goes spec -> config -> spec too, so that facts config.json does not carry
    (SSMax constants, rounding points, NVFP4 layout) are the defaults on both sides and never differ. Keys absent
    from config.json mean BeamConfig's defaults, as for transformers. Deliberately not compared:
    - name, initializer_range: not facts of the weights (initializer_range only draws random ones);
    - the weight groups' dtypes: config.json has one `dtype` while a spec may store groups differently (norms in
      fp32 ...), and the loader checks every tensor's stored dtype against the spec. `dtype` is compared with
      dtypes.activations (what spec_to_hf_config writes), when config.json gives it;
    - experts: only NVFP4 or not (quantization_config.quant_algo); an unquantized dtype is checked per tensor;
    - dtypes.kv_cache: the KV cache format is the server's choice, not the checkpoint's (a bf16 cache ignores the
      checkpoint's KV scales, an fp8 cache without them uses 1.0).
    """
    got = hf_config_to_spec(cfg, spec.name, source)
    want = hf_config_to_spec(spec_to_hf_config(spec), spec.name)
    out: dict[str, str] = {}  # config key -> line: one line per key (rms_norm_eps feeds two spec fields)

    def add(key: str, path: str, a: Any, b: Any) -> None:
        side = f"{a!r}" if key == path else f"{path} = {a!r}"
        out.setdefault(key, f"{key}: spec has {side}, config.json has {b!r}")

    def walk(a: Any, b: Any, path: tuple) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in a:
                walk(a[k], b[k], path + (k,))
        elif a != b:
            add(_config_key(path), fmt_path(path), a, b)

    skip = ("name", "initializer_range", "layers", "dtypes")  # layers: compared per layer below
    a, b = want.model_dump(), got.model_dump()
    walk({k: v for k, v in a.items() if k not in skip}, {k: v for k, v in b.items() if k not in skip}, ())
    for key, x, y in (("layer_types", want.attention_types, got.attention_types),
                      ("mlp_layer_types", want.mlp_types, got.mlp_types)):
        if len(x) == len(y):  # else num_hidden_layers differs, and says so
            for i in (i for i in range(len(x)) if x[i] != y[i]):
                add(f"{key}[{i}]", f"{key}[{i}]", x[i], y[i])
    if (want.dtypes.experts == "nvfp4") != (got.dtypes.experts == "nvfp4"):
        add("quantization_config.quant_algo", "dtypes.experts", want.dtypes.experts,
            "NVFP4" if got.dtypes.experts == "nvfp4" else None)
    if (cfg.get("dtype") or cfg.get("torch_dtype")) and want.dtypes.activations != got.dtypes.activations:
        add("dtype", "dtypes.activations", want.dtypes.activations, got.dtypes.activations)
    return list(out.values())


def _flow(v: Any) -> str:
    """A scalar, or a short mapping in flow style ({a: 1, b: 2}), as YAML text."""
    return yaml.safe_dump(v, default_flow_style=True, sort_keys=False, width=1 << 30).strip().removesuffix("\n...")


def _emit(d: dict[str, Any], indent: int, out: list[str]) -> None:
    pad = " " * indent
    for k, v in d.items():
        if indent == 0 and isinstance(v, dict):  # a blank line before each top-level section
            out.append("")
        if isinstance(v, list):  # per-layer lists: one entry a line, numbered, so that a layer is easy to find
            out.append(f"{pad}{k}:")
            out += [f"{pad}  - {_flow(x):<18} # layer {i}" for i, x in enumerate(v)]
        elif isinstance(v, dict) and (any(isinstance(x, (dict, list)) for x in v.values())
                                      or len(pad + k + _flow(v)) > 100):
            out.append(f"{pad}{k}:")
            _emit(v, indent + 2, out)
        else:
            out.append(f"{pad}{k}: {_flow(v)}")


def spec_to_yaml(spec: ModelSpec, header: str = "") -> str:
    """The spec as YAML for people: every value written out, block style with short flow maps, `#` header lines."""
    data = spec.model_dump()
    lp = data["layers"]
    # An explicit list overrides its rule; leave out whichever side is not in force.
    for key, unused in (("attention", ("full_every", "last_is_full")), ("mlp", ("dense_first",))):
        for k in unused if lp[key] is not None else (key,):
            del lp[k]
    out = [f"# {line}".rstrip() for line in header.splitlines()]
    _emit(data, 0, out)
    return "\n".join(out) + "\n"


def import_hf(config_path: str | Path, output: str | Path | None = None, name: str | None = None) -> ModelSpec:
    """`beamc import-hf`: write the spec YAML of a checkpoint's config.json (or its directory) to `output`/stdout."""
    from beamc.errors import check_output_file, check_readable, read_error

    max_bytes = 16 << 20  # a config.json is a few KB; a larger file is the wrong path
    p = Path(config_path)
    if p.is_dir() and (p.suffix != ".json" or (p / "config.json").exists()):  # a checkpoint directory
        p = p / "config.json"
    if not p.exists():
        raise BeamcError(str(p), "config file not found", "pass a checkpoint's config.json or its directory")
    check_readable(p, "config")  # a directory named config.json, a FIFO, no permission
    if p.stat().st_size > max_bytes:
        raise BeamcError(str(p), f"larger than {max_bytes >> 20} MiB; a config.json is a few KB",
                         "pass a checkpoint's config.json or its directory")
    if output is not None:
        check_output_file(output, "-o")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BeamcError(f"{p}:{e.lineno}", f"not valid JSON: {e.msg} (column {e.colno})") from None
    except UnicodeDecodeError:
        raise BeamcError(str(p), "not a UTF-8 text file; expected a config.json") from None
    except OSError as e:
        raise read_error(p, e, "config") from None
    if not isinstance(cfg, dict):
        raise BeamcError(str(p), f"expected a JSON object at the top level, got {type(cfg).__name__}")
    spec = hf_config_to_spec(cfg, name or p.resolve().parent.name or "beam", source=str(p))
    text = spec_to_yaml(spec, header=(
        f"{spec.name}: imported by `beamc import-hf` from {p}.\n"
        "Values config.json does not carry (SSMax q scale, rounding points, NVFP4 layout) are the ones\n"
        "transformers' Beam code hard-codes."))
    if output is None:
        sys.stdout.write(text)  # only the YAML: it is piped
    else:
        try:
            Path(output).write_text(text)
        except OSError as e:
            raise BeamcError(str(output), f"cannot write the spec: {e.strerror}") from None
        print(f"wrote {output}: the spec of {spec.name} (from {p})")
    return spec
