"""The options of every pooling head and loss, with their defaults and help: declared here once.

Each component declares a frozen dataclass of its options, one `option(...)` per keyword
of its constructor (or registry factory) that has a default. Everything else reads them:

- the constructors take their defaults from the class attributes
  (`CCBP(in_dim, d=CCBPOptions.d, ...)`: a dataclass field's default is its class attribute);
- `POOLINGS` and `LOSSES` map the names of `--pool` and `--loss` to those classes, in the
  order `--help` lists them; an option with a `flag` is set by that field of fit's config
  (training/config.py) and its `--flag`, whose help and default `flag_options` derives.

A flag shared by several components (`--pool-dim` of ccbp and jcf) is one field, declared
once: by a shared base class (JCFOptions extends CCBPOptions) or by one helper
(`_temperature`) where the components' defaults differ.

This module imports no torch: `vitrieval-train --help` reads it and stays fast.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

BOUNDS = (">", ">=")
"""How an option's `bound` compares: `(">", 0)` is "must be > 0"."""


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    unset: bool = False,
    bound: tuple[str, float] | None = None,
    choices: tuple[str, ...] = (),
) -> Any:
    """One option of a component, as a dataclass field.

    default: the constructor's default. help: one phrase, read after the component
    names (`ccbp/jcf: <help>`). flag: the field of fit's config (and `--flag`) that
    sets it; None: a constructor argument only. unset: fit's config keeps None until
    the flag is given (config.yaml then says null) and the component's default applies.
    bound: the rule fit's config checks a given value against. choices: the valid values.
    """
    if bound is not None and bound[0] not in BOUNDS:
        raise ValueError(f"bound must compare with one of {BOUNDS}, got {bound[0]!r}")
    metadata = {"help": help, "flag": flag, "unset": unset, "bound": bound, "choices": choices}
    return field(default=default, metadata=metadata)


# -- poolings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NoOptions:
    """A component without options (cls, avg and max pooling)."""


@dataclass(frozen=True)
class GeMOptions:
    """GeM (training/pooling/gem.py), and the exponent, clamp and learn_p of GGeM."""

    p: float = option(3.0, "initial exponent p", flag="pool_p")
    eps: float = option(1e-6, "activations are clamped to at least eps before the power")
    learn_p: bool = option(True, "train the exponents (else keep them fixed)")


@dataclass(frozen=True)
class GGeMOptions(GeMOptions):
    """GGeM (training/pooling/ggem.py); the registry's factory resolves `groups`."""

    groups: int | None = option(
        None,
        "number of channel groups (default: the backbone's number of heads)",
        flag="pool_groups",
        bound=(">=", 1),
    )


@dataclass(frozen=True)
class CCBPOptions:
    """C-CBP (training/pooling/ccbp.py); the sizes are the paper's."""

    d: int = option(
        256, "width d of the reduced local features", flag="pool_dim", unset=True, bound=(">=", 1)
    )
    out_dim: int = option(512, "output width D", flag="pool_out_dim", unset=True, bound=(">=", 1))
    codebook: int = option(32, "codebook size N", flag="pool_codebook", unset=True, bound=(">=", 1))
    scale: float = option(10.0, "initial softmax scale s of the soft assignment (learnable)")


@dataclass(frozen=True)
class JCFOptions(CCBPOptions):
    """JCF (training/pooling/jcf.py): C-CBP's options and the number of shared projectors."""

    rank: int = option(
        8, "number R of shared projectors", flag="pool_rank", unset=True, bound=(">=", 1)
    )


POOLINGS: dict[str, type] = {
    "cls": NoOptions,
    "avg": NoOptions,
    "max": NoOptions,
    "gem": GeMOptions,
    "ggem": GGeMOptions,
    "ccbp": CCBPOptions,
    "jcf": JCFOptions,
}
"""`--pool` names (training/pooling/__init__.py registers one module each) -> options."""


# -- losses -----------------------------------------------------------------------------


def _temperature(default: float, flag: str | None = "temperature") -> Any:
    """The softmax temperature tau of a loss: the same help and rule, its own default."""
    return option(default, "softmax temperature tau", flag=flag, unset=True, bound=(">", 0))


@dataclass(frozen=True)
class NormSoftmaxOptions:
    """Norm-softmax (training/losses/norm_softmax.py): 0.05 as in Zhai & Wu."""

    temperature: float = _temperature(0.05)


@dataclass(frozen=True)
class SupConOptions:
    """SupCon (training/losses/supcon.py): 0.1 as in LaCViT."""

    temperature: float = _temperature(0.1)


MINING = ("all", "batch_hard", "semi_hard")
DISTANCES = ("cosine", "euclidean")


@dataclass(frozen=True)
class TripletOptions:
    """Triplet margin loss (training/losses/triplet.py)."""

    margin: float = option(0.1, "margin", flag="margin", bound=(">", 0))
    mining: str = option("batch_hard", "in-batch mining", flag="mining", choices=MINING)
    distance: str = option(
        "cosine", "distance between the L2-normalised embeddings", choices=DISTANCES
    )


LOSSES: dict[str, type] = {
    "norm_softmax": NormSoftmaxOptions,
    "triplet": TripletOptions,
    "supcon": SupConOptions,
}
"""`--loss` names (training/losses/__init__.py registers them) -> options."""


@dataclass(frozen=True)
class InfoNCEOptions:
    """Global InfoNCE of `pretrain` (training/losses/info_nce.py): SimCLR's temperature."""

    temperature: float = _temperature(0.1, flag=None)


NEGATIVES = ("random", "guided", "densecl")
GUIDED_CROSS_VIEW_NEGATIVES = 64
"""Cross-view negatives of the guided negatives (the paper's DenseCL++* of Table 2)."""


@dataclass(frozen=True)
class DenseContrastiveOptions:
    """Dense contrastive loss of `pretrain` (training/losses/dense_contrastive.py)."""

    negatives: str = option("random", "dense negatives", choices=NEGATIVES)
    temperature: float = _temperature(0.1, flag=None)
    candidates: int = option(256, "guided: number M of candidate negative sets")
    beta: float = option(0.5, "guided: similarity threshold of eq. 3")
    cross_view_negatives: int | None = option(
        None,
        "N least similar tokens of the positive view as extra negatives "
        f"(default: {GUIDED_CROSS_VIEW_NEGATIVES} guided, 0)",
    )


def default_cross_view_negatives(negatives: str) -> int:
    """The default N of DenseContrastiveOptions.cross_view_negatives for `negatives`."""
    return GUIDED_CROSS_VIEW_NEGATIVES if negatives == "guided" else 0


# -- what fit's config derives ----------------------------------------------------------


@dataclass(frozen=True)
class FlagOption:
    """One field of fit's config (and its `--flag`) that sets components' options.

    takers: component name -> the option it sets (`{"ccbp": "d", "jcf": "d"}`), in the
    table's order; defaults: component name -> that option's declared default.
    """

    name: str
    help: str
    default: Any
    takers: dict[str, str]
    defaults: dict[str, Any]
    unset: bool
    bound: tuple[str, float] | None
    choices: tuple[str, ...]

    def default_for(self, component: str) -> Any:
        """The declared default of the component's option (KeyError: it takes none)."""
        return self.defaults[component]

    def violated(self, value: Any) -> str | None:
        """The broken rule ("must be >= 1, got 0") of a given value, or None."""
        if value is None:
            return None
        if self.choices and value not in self.choices:
            return f"must be one of {' | '.join(self.choices)}, got {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            # NaN passes every comparison's "not below", and a model built from it
            # answers NaN
            return f"must be a finite number, got {value}"
        if self.bound is None:
            return None
        op, limit = self.bound
        ok = value > limit if op == ">" else value >= limit
        return None if ok else f"must be {op} {limit}, got {value}"


def flag_options(table: dict[str, type]) -> dict[str, FlagOption]:
    """The fields of fit's config that set options of `table`'s components, in order.

    Components that share a flag declare it once (the same help, rule and choices); the
    config's default is the declared one, or None where the flag is `unset` (and the help
    then names the declared defaults).
    """
    uses: dict[str, list[tuple[str, Field]]] = {}
    for component, cls in table.items():
        for f in fields(cls):
            if f.metadata.get("flag"):
                uses.setdefault(f.metadata["flag"], []).append((component, f))
    return {flag: _flag_option(flag, found) for flag, found in uses.items()}


def _flag_option(flag: str, found: list[tuple[str, Field]]) -> FlagOption:
    first = found[0][1]
    shared = ("help", "unset", "bound", "choices")
    for component, f in found[1:]:
        if any(f.metadata[key] != first.metadata[key] for key in shared):
            raise ValueError(f"{component} declares flag {flag} unlike {found[0][0]}")
    defaults = {component: f.default for component, f in found}
    if MISSING in defaults.values():
        raise ValueError(f"every option set by {flag} needs a default")
    unset = first.metadata["unset"]
    values = list(dict.fromkeys(defaults.values()))
    if len(values) > 1 and not unset:
        raise ValueError(f"{flag}: components with different defaults need unset=True")
    text = first.metadata["help"]
    if first.metadata["choices"]:
        text += f", one of {' | '.join(first.metadata['choices'])}"
    if unset and len(values) == 1:
        text += f" (default: {values[0]})"
    elif unset:
        text += f" (default: {', '.join(f'{c} {v}' for c, v in defaults.items())})"
    return FlagOption(
        name=flag,
        help=f"{'/'.join(defaults)}: {text}",
        default=None if unset else values[0],
        takers={component: f.name for component, f in found},
        defaults=defaults,
        unset=unset,
        bound=first.metadata["bound"],
        choices=first.metadata["choices"],
    )
