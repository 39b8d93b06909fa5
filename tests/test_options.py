"""Pooling and loss options are declared once (training/options.py): the constructors,
fit's config and its flags all take their defaults and help from there."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import yaml

from vitrieval.training.cli import build_parser
from vitrieval.training.config import (
    LOSS_FLAGS,
    LOSS_OPTIONS,
    POOL_FLAGS,
    POOL_OPTIONS,
    ConfigError,
    FitConfig,
    config_from_args,
    load_config_file,
)
from vitrieval.training.losses import (
    DenseContrastiveLoss,
    InfoNCELoss,
    NormSoftmaxLoss,
    SupConLoss,
    TripletMarginLoss,
    create_loss,
    loss_names,
)
from vitrieval.training.losses.registry import LOSSES as LOSS_REGISTRY
from vitrieval.training.options import (
    LOSSES,
    POOLINGS,
    DenseContrastiveOptions,
    InfoNCEOptions,
    option,
)
from vitrieval.training.options import flag_options as derive_flags
from vitrieval.training.pooling import CCBP, JCF, GeM, GGeM, create_pooling, pooling_names
from vitrieval.training.pooling.registry import POOLINGS as POOL_REGISTRY

CONSTRUCTORS = {
    "gem": GeM,
    "ggem": GGeM,
    "ccbp": CCBP,
    "jcf": JCF,
    "norm_softmax": NormSoftmaxLoss,
    "triplet": TripletMarginLoss,
    "supcon": SupConLoss,
}
"""The class each registered name builds (the registry's factory adds the rest)."""

UNREGISTERED = [(InfoNCELoss, InfoNCEOptions), (DenseContrastiveLoss, DenseContrastiveOptions)]


def declared(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in fields(cls)}


def constructor_default(name: str, option_name: str, registry) -> object:
    """The default of `option_name` in the class's signature, else in the factory's."""
    for builder in (CONSTRUCTORS.get(name), registry.get(name)):
        parameters = inspect.signature(builder).parameters if builder else {}
        param = parameters.get(option_name)
        if param is not None and param.default is not inspect.Parameter.empty:
            return param.default
    raise AssertionError(f"{name}: neither constructor nor factory has a default {option_name}")


def test_the_tables_name_every_registered_pooling_and_loss_in_help_order():
    assert set(POOLINGS) == set(pooling_names())
    assert set(LOSSES) == set(loss_names())
    help_text = {a.dest: a.help for a in _fit_actions()}
    assert help_text["pool"].startswith(f"pooling head: {' | '.join(POOLINGS)} (default: ")
    assert help_text["loss"].startswith(f"training loss: {' | '.join(LOSSES)} (default: ")


@pytest.mark.parametrize(
    ("name", "registry", "table"),
    [(n, POOL_REGISTRY, POOLINGS) for n in POOLINGS] + [(n, LOSS_REGISTRY, LOSSES) for n in LOSSES],
    ids=[*POOLINGS, *LOSSES],
)
def test_constructor_defaults_are_the_declared_objects(name, registry, table):
    for option_name, default in declared(table[name]).items():
        assert constructor_default(name, option_name, registry) is default, (name, option_name)


@pytest.mark.parametrize(("loss", "options"), UNREGISTERED)
def test_pretrain_loss_defaults_are_the_declared_objects(loss, options):
    parameters = inspect.signature(loss).parameters
    for option_name, default in declared(options).items():
        assert parameters[option_name].default is default, (loss.__name__, option_name)


def test_no_constructor_or_factory_restates_a_declared_default():
    """A literal default of a declared option's keyword (even one equal to the declared
    value, which the identity checks above cannot tell for small ints) is written twice."""
    names = {f.name for cls in [*POOLINGS.values(), *LOSSES.values()] for f in fields(cls)}
    names |= {f.name for _, cls in UNREGISTERED for f in fields(cls)}
    root = Path(__file__).resolve().parents[1] / "training"
    restated = []
    for path in sorted([*root.glob("pooling/*.py"), *root.glob("losses/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            with_default = positional[len(positional) - len(args.defaults) :]
            pairs = [*zip(with_default, args.defaults, strict=True)]
            # a keyword-only argument without a default has None here, not a Constant
            pairs += [*zip(args.kwonlyargs, args.kw_defaults, strict=True)]
            restated += [
                f"{path.name}:{default.lineno} {node.name}({arg.arg}={default.value!r})"
                for arg, default in pairs
                if arg.arg in names and isinstance(default, ast.Constant)
            ]
    assert restated == []


def _fit_actions():
    parser = build_parser()
    fit = parser._subparsers._group_actions[0].choices["fit"]
    return fit._actions


@pytest.mark.parametrize("flag", [*POOL_FLAGS.values(), *LOSS_FLAGS.values()], ids=lambda f: f.name)
def test_config_and_cli_defaults_come_from_the_declaration(flag):
    table = POOLINGS if flag.name in POOL_FLAGS else LOSSES
    for component, option_name in flag.takers.items():
        assert flag.default_for(component) is declared(table[component])[option_name]
    # the config's field: the declared default, or None where the flag is unset
    field = next(f for f in fields(FitConfig) if f.name == flag.name)
    assert field.default is flag.default
    values = list(dict.fromkeys(flag.defaults.values()))
    assert flag.default is (None if flag.unset else values[0])
    # the flag: unset on the command line (so a --config file can fill it), and its help
    # names every declared default
    action = next(a for a in _fit_actions() if a.dest == flag.name)
    assert action.option_strings == [f"--{flag.name.replace('_', '-')}"]
    assert action.default is None
    assert action.help.startswith(flag.help)
    for default in values:
        if default is not None:
            assert f"{default})" in action.help or f"{default}," in action.help, action.help
    # without the flag, the config holds the declared default (or None)
    args = build_parser().parse_args(["fit", "--out", "x"])
    assert getattr(config_from_args(args), flag.name) is flag.default


def test_config_fields_of_components_are_exactly_the_declared_flags():
    hints = typing.get_type_hints(FitConfig)
    marked = {f.name for f in fields(FitConfig) if "component" in f.metadata}
    assert marked == set(POOL_FLAGS) | set(LOSS_FLAGS)
    for flag in [*POOL_FLAGS.values(), *LOSS_FLAGS.values()]:
        table = POOLINGS if flag.name in POOL_FLAGS else LOSSES
        for component, option_name in flag.takers.items():
            declared_type = typing.get_type_hints(table[component])[option_name]
            expected = declared_type | None if flag.unset else declared_type
            assert hints[flag.name] == expected, (flag.name, component)


def test_trainer_tables_are_derived():
    assert POOL_OPTIONS == {
        "gem": {"p": "pool_p"},
        "ggem": {"p": "pool_p", "groups": "pool_groups"},
        "ccbp": {"d": "pool_dim", "out_dim": "pool_out_dim", "codebook": "pool_codebook"},
        "jcf": {
            "d": "pool_dim",
            "out_dim": "pool_out_dim",
            "codebook": "pool_codebook",
            "rank": "pool_rank",
        },
    }
    # the trainer passes each loss field as the option of the same name
    assert all(f.takers[loss] == f.name for f in LOSS_FLAGS.values() for loss in f.takers)
    assert LOSS_OPTIONS == {
        "norm_softmax": ("temperature",),
        "triplet": ("margin", "mining"),
        "supcon": ("temperature",),
    }


def test_config_yaml_keeps_its_pooling_and_loss_entries(tmp_path):
    """What runs recorded before the options were declared in one place: the same keys in
    the same order and values; such a file loads back to the same config."""
    cfg = FitConfig(out=str(tmp_path), pool="jcf", loss="triplet").resolved()
    cfg.save(tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    keys = list(saved)
    start = keys.index("pool_p")
    assert keys[start : start + 6] == [
        "pool_p",
        "pool_groups",
        "pool_dim",
        "pool_out_dim",
        "pool_codebook",
        "pool_rank",
    ]
    assert keys[keys.index("loss") + 1 : keys.index("loss") + 4] == [
        "temperature",
        "margin",
        "mining",
    ]
    recorded = {
        "pool_p": 3.0,
        "pool_groups": None,
        "pool_dim": None,
        "pool_out_dim": None,
        "pool_codebook": None,
        "pool_rank": None,
        "temperature": 0.05,
        "margin": 0.1,
        "mining": "batch_hard",
    }
    assert {k: saved[k] for k in recorded} == recorded
    assert FitConfig(**load_config_file(tmp_path / "config.yaml")) == cfg


@pytest.mark.parametrize(
    "name, content",
    [
        ("deep.json", b"[" * 20_000 + b"]" * 20_000),  # nested past the parser's depth
        ("latin.json", b'{"epochs": "\xe9"}'),  # not UTF-8
        ("bad.yaml", b"epochs: [1"),
    ],
)
def test_an_unreadable_config_file_is_one_config_error(tmp_path, name, content) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=f"cannot parse .*{name}"):
        load_config_file(tmp_path / name)


BUILT = {
    "p": lambda m: m.p[0].item(),
    "eps": lambda m: m.eps,
    "learn_p": lambda m: m.p.requires_grad,
    "groups": lambda m: m.groups,
    "d": lambda m: m.d,
    "out_dim": lambda m: m.out_dim,
    "codebook": lambda m: m.codebook_size,
    "rank": lambda m: m.rank,
    "scale": lambda m: pytest.approx(m.scale.item()),
}
"""How to read each pooling option back from a built head."""


@pytest.mark.parametrize("pool", [p for p in POOLINGS if p in POOL_OPTIONS])
def test_a_default_config_builds_the_declared_pooling(pool):
    """What fit's trainer passes (the config fields that are not None) gives the head
    the declared options."""
    cfg = FitConfig(out="x", pool=pool).resolved()
    given = {opt: getattr(cfg, f) for opt, f in POOL_OPTIONS[pool].items()}
    module, _ = create_pooling(pool, 16, 4, **{k: v for k, v in given.items() if v is not None})
    for option_name, default in declared(POOLINGS[pool]).items():
        expected = 4 if option_name == "groups" else default  # None: one group per head
        assert BUILT[option_name](module) == expected, (pool, option_name)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_default_config_builds_the_declared_loss(loss):
    cfg = FitConfig(out="x", loss=loss).resolved()
    built = create_loss(loss, 4, 3, **{name: getattr(cfg, name) for name in LOSS_OPTIONS[loss]})
    for option_name, default in declared(LOSSES[loss]).items():
        assert getattr(built, option_name) == default, (loss, option_name)


def test_losses_without_a_temperature_resolve_the_default_loss_one():
    default_loss = next(f.default for f in fields(FitConfig) if f.name == "loss")
    expected = LOSS_FLAGS["temperature"].default_for(default_loss)
    assert FitConfig(out="x", loss="triplet").resolved().temperature == expected


def test_shared_flags_must_be_declared_alike():
    @dataclass(frozen=True)
    class A:
        size: int = option(4, "size", flag="size")

    @dataclass(frozen=True)
    class B:
        size: int = option(5, "size", flag="size")

    @dataclass(frozen=True)
    class C:
        size: int = option(4, "another text", flag="size")

    with pytest.raises(ValueError, match="different defaults need unset"):
        derive_flags({"a": A, "b": B})
    with pytest.raises(ValueError, match="c declares flag size unlike a"):
        derive_flags({"a": A, "c": C})
    flag = derive_flags({"a": A})["size"]
    assert (flag.help, flag.default, flag.violated(0)) == ("a: size", 4, None)


def test_bounds_are_the_declared_rules():
    assert POOL_FLAGS["pool_rank"].violated(0) == "must be >= 1, got 0"
    assert POOL_FLAGS["pool_rank"].violated(None) is None
    assert LOSS_FLAGS["temperature"].violated(0.0) == "must be > 0, got 0.0"
    assert POOL_FLAGS["pool_p"].violated(float("nan")) == "must be a finite number, got nan"
    assert LOSS_FLAGS["temperature"].violated(float("inf")) == "must be a finite number, got inf"
    with pytest.raises(ValueError, match="bound"):
        option(1, "x", bound=("<", 3))


HELP_MODULES = """
import sys
from vitrieval.training.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "timm", "torchvision"))
print("HEAVY", heavy, "vitrieval.training.options" in sys.modules)
"""


@pytest.mark.parametrize(
    "argv", [["--help"], ["fit", "--help"], ["export", "--help"], ["pretrain", "--help"]]
)
def test_help_reads_the_declarations_without_importing_torch(argv):
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-c", HELP_MODULES, *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: vitrieval-train")
    assert result.stdout.splitlines()[-1] == "HEAVY [] True"
