#!/usr/bin/env python3
"""Import a recipe of the Spark ecosystem (eugr/spark-vllm-docker ``recipes/*.yaml``,
spark-arena/recipe-registry) into a model catalogue entry (docs/model-catalogue.md), every flag of its
``vllm serve`` command checked by the target vLLM release's own argument parser.

Where it runs: the flag check needs that vLLM release importable (no GPU). Run it

- in the contract environment: ``.venv-vllm/bin/python scripts/recipe_import.py R.yaml --release 0.19.1``, and
  for 0.26.0 the same interpreter with ``--vllm-path .cache/vllm-0.26.0-py`` (the default when that directory
  exists; tests/contract/setup_vllm_env.sh makes it), or
- inside the variant's image we build: ``docker run --rm -v "$PWD:/w" -w /w <our image> python3
  scripts/recipe_import.py R.yaml --release <its version>``.

The vLLM part runs in a child process of the same interpreter (``--parse-worker``, vLLM forced to its CPU
platform); everything else (reading the YAML, substituting ``{placeholders}``, shell-splitting the command,
mapping flags to our knobs, refusing) is plain Python, unit-tested without vLLM
(tests/unit/test_recipe_import.py).

The output (stdout or ``--out``) is ``{name: entry}``, one entry that filter_plugins/spark_models.py's
``spark_model_entry_errors`` accepts, to paste under ``spark_model_catalogue`` or set in the inventory's
``spark_model_catalogue_local``: one checkpoint (role checkpoint, mode full, the ``--revision`` commit or
main), assembly none, model_dir = the name, sizes null (unknown: the deploy asks for them), methods baseline
plus the recipe's speculative method, and under not_applied each setting no knob or field of the entry takes.

Exit codes: 0 the entry was written; 1 the recipe was refused (one line per reason on stderr, ``FILE:LINE:
reason``) or the check failed; 2 usage (bad arguments, unreadable recipe, no vLLM of that release here).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import string
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "filter_plugins"))
sys.path.insert(0, str(ROOT / "scripts"))

import spark_methods  # noqa: E402  (filter_plugins/, put on sys.path above)
import spark_models  # noqa: E402  (the catalogue's own entry check)
from sparkllm.cli import EXIT_DONE, EXIT_FAILED, EXIT_USAGE, UsageError, doc_parser, say_error  # noqa: E402
from sparkllm.fileio import write_bytes_atomic  # noqa: E402

TOOL = "recipe_import"
METHODS_YML = ROOT / "group_vars" / "all" / "methods.yml"
BUILD_DEFAULTS = ROOT / "roles" / "vllm_build" / "defaults" / "main.yml"
WORKER_TAG = "RECIPE_IMPORT_PARSE "

# Top-level keys of the two recipe schemas: eugr's run-recipe.py (recipe_version "1": name, recipe_version,
# container, command required; description, model, mods, defaults, env, build_args, cluster_only, solo_only
# optional) and the registry's recipe_version "2" (adds runtime and metadata, drops name).
RECIPE_KEYS = {"recipe_version", "name", "description", "model", "runtime", "container", "metadata", "mods",
               "defaults", "env", "command", "build_args", "cluster_only", "solo_only"}
RECIPE_VERSIONS = ("1", "2")
# Options a catalogue entry does not carry: where the server listens is the owner's (vllm_host, vllm_port,
# nginx in front on a LAN address), not the model's. Recorded under not_applied, never refused.
DEPLOYMENT_OPTIONS = {"--host", "--port"}
# Options refused outright, with the reason (besides those _MANAGED_OPTIONS gives to "the cluster stage").
REFUSED_OPTIONS = {
    "--api-key": "a key in a recipe is a leaked secret; the toolkit passes vllm_api_key_file's key in the "
                 "environment",
    "--disable-log-stats": "the toolkit keeps stats logging on (speculative-decoding metrics need it)",
    "--distributed-executor-backend": "the executor backend is the cluster stage's "
                                      "(spark_distributed_backend)",
}
# Options whose value names a file of the recipe's container or its mods (a jinja template the mods copy
# in), which our image does not hold: refused; the checkpoint's own template serves.
FILE_OPTIONS = {"--chat-template"}


@dataclass
class Refusal:
    line: int
    reason: str


@dataclass
class Flag:
    """One option as written (``words``), the line it starts on, and what the parser made of it."""

    words: list[str]
    line: int
    option: str = ""          # canonical long option (filled by the parser check)
    changed: dict = field(default_factory=dict)  # parser dests this option set, with their values
    error: str | None = None  # the parser's complaint, or None


@dataclass
class Recipe:
    path: str
    doc: dict
    lines: dict[str, int]           # "key" and "key.sub" -> 1-based line in the file
    command_line: int               # line of the first command line
    command_lines: list[str]        # the command's physical lines, placeholders substituted


class RecipeError(Exception):
    def __init__(self, refusals: list[Refusal]):
        super().__init__("; ".join(r.reason for r in refusals))
        self.refusals = refusals


# --- reading the recipe -------------------------------------------------------------------------------------

def _key_lines(node, prefix: str = "") -> dict[str, int]:
    """1-based lines of every mapping key, nested keys as 'a.b'."""
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                name = prefix + str(key.value)
                out[name] = key.start_mark.line + 1
                out.update(_key_lines(value, name + "."))
    return out


def read_recipe(text: str, path: str = "<recipe>") -> Recipe:
    """Parse and check a recipe's YAML; substitute the command's {placeholders}. Raises RecipeError."""
    try:
        root = yaml.compose(text)
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or exc
        raise RecipeError([Refusal(line, f"not valid YAML: {problem}")]) from None
    if not isinstance(doc, dict):
        raise RecipeError([Refusal(1, "a recipe is a YAML mapping (model, container, defaults, env, "
                                      "command)")])
    lines = _key_lines(root)
    refusals = []
    for key in doc:
        if key not in RECIPE_KEYS:
            refusals.append(Refusal(lines.get(str(key), 1), f"unknown recipe key {key!r}; known keys: "
                                    f"{', '.join(sorted(RECIPE_KEYS))}"))
    version = doc.get("recipe_version")
    if version is not None and str(version) not in RECIPE_VERSIONS:
        refusals.append(Refusal(lines.get("recipe_version", 1), f"recipe_version {version!r} is not one this "
                                f"importer reads ({', '.join(RECIPE_VERSIONS)})"))
    if doc.get("runtime") not in (None, "vllm"):
        refusals.append(Refusal(lines["runtime"], f"runtime {doc['runtime']!r}: only vllm recipes import"))
    for key in ("defaults", "env", "metadata"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            refusals.append(Refusal(lines[key], f"{key} must be a mapping"))
    for key in ("mods", "build_args"):
        if doc.get(key) is not None and not isinstance(doc[key], list):
            refusals.append(Refusal(lines[key], f"{key} must be a list"))
    command = doc.get("command")
    if not isinstance(command, str) or not command.strip():
        refusals.append(Refusal(lines.get("command", 1), "command is missing or empty; a recipe's command is "
                                "the `vllm serve MODEL --flags` line"))
    if refusals:
        raise RecipeError(refusals)
    cmd_node = next(v for k, v in root.value if k.value == "command")
    # a block scalar (| or >) starts on the line after its key; a flow scalar on the key's line
    first = cmd_node.start_mark.line + (2 if cmd_node.style in ("|", ">") else 1)
    physical = command.splitlines()
    substituted, subs_refusals = _substitute(physical, doc, first)
    if subs_refusals:
        raise RecipeError(subs_refusals)
    return Recipe(path, doc, lines, first, substituted)


def _substitute(physical: list[str], doc: Mapping, first: int) -> tuple[list[str], list[Refusal]]:
    """Replace {name} placeholders with the recipe's defaults (and {model}), as the recipe runners' str.format
    does ({{ and }} are literal braces). Unknown names are refused with their line."""
    values = {str(k): v for k, v in (doc.get("defaults") or {}).items()}
    if doc.get("model") is not None:
        values.setdefault("model", doc["model"])
    out, refusals = [], []
    for i, text in enumerate(physical):
        try:
            fields = list(string.Formatter().parse(text))
        except ValueError as exc:
            refusals.append(Refusal(first + i, f"command: {exc} (a literal brace is written {{{{ or }}}})"))
            continue
        missing = [f for _, f, _, _ in fields if f is not None and f not in values]
        if missing:
            refusals.append(Refusal(first + i, f"command uses {{{missing[0]}}}, which defaults does not "
                                    f"define; add it under defaults"))
            continue
        out.append(text.format_map(values))
    return out, refusals


# --- the command --------------------------------------------------------------------------------------------

_SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1"}


def split_command(lines: list[str], first: int) -> list[tuple[str, int]]:
    """Shell words of the command with the line each starts on. A quoted word may span lines (a JSON
    --speculative-config written over several); expansions and operators are refused (no shell runs here)."""
    words: list[tuple[str, int]] = []
    i = 0
    while i < len(lines):
        start, chunk = i, ""
        while True:
            text = lines[i].rstrip()
            cont = text.endswith("\\") and not text.endswith("\\\\")
            chunk += (text[:-1] if cont else text) + " "
            try:
                parts = shlex.split(chunk, comments=True)
            except ValueError:
                if i + 1 >= len(lines):
                    refusal = Refusal(first + start, "command: unbalanced quote (no closing quotation)")
                    raise RecipeError([refusal]) from None
                chunk = chunk[:-1] + "\n"
                i += 1
                continue
            break
        if "$" in chunk or "`" in chunk:
            raise RecipeError([Refusal(first + start, "command uses a shell expansion ($ or `); write the "
                                       "value itself or put it under defaults")])
        words += [(w, first + start) for w in parts]
        i += 1
    for word, line in words:
        if word in _SHELL_OPERATORS:
            raise RecipeError([Refusal(line, f"command has the shell operator {word!r}; a recipe's command "
                                       f"is one `vllm serve` invocation")])
    return words


def _is_value(word: str) -> bool:
    return not word.startswith("-") or re.fullmatch(r"-\d[\d.eE+-]*", word) is not None


def parse_command(lines: list[str], first: int) -> tuple[str, int, list[Flag]]:
    """(model, its line, the option groups) of a `vllm serve MODEL --opt value ...` command."""
    words = split_command(lines, first)
    if not words:
        raise RecipeError([Refusal(first, "command is empty")])
    if "=" in words[0][0] and not words[0][0].startswith("-"):
        raise RecipeError([Refusal(words[0][1], f"command starts with the assignment {words[0][0]!r}; put "
                                   f"environment variables under env")])
    if [w for w, _ in words[:2]] != ["vllm", "serve"]:
        raise RecipeError([Refusal(words[0][1], "command does not start with `vllm serve`; only vLLM's own "
                                   "CLI imports")])
    rest = words[2:]
    model, model_line = None, first
    if rest and _is_value(rest[0][0]):
        (model, model_line), rest = rest[0], rest[1:]
    flags: list[Flag] = []
    for word, line in rest:
        if not _is_value(word):
            flags.append(Flag([word], line))
        elif flags and "=" not in flags[-1].words[0]:
            flags[-1].words.append(word)
        else:
            raise RecipeError([Refusal(line, f"command has the stray word {word!r}; every word after the "
                                       f"model belongs to an option")])
    model_options = ("--model", "--model-tag")
    for flag in flags:
        head, _, inline = flag.words[0].partition("=")
        if head.replace("_", "-") in model_options:
            value = inline or (flag.words[1:] or [None])[0]
            if model is None and value:
                model, model_line = value, flag.line
    if model is None:
        raise RecipeError([Refusal(first, "command names no model (`vllm serve MODEL ...`)")])
    flags = [f for f in flags if f.words[0].split("=", 1)[0].replace("_", "-") not in model_options]
    return model, model_line, flags


# --- the vLLM side (child process) --------------------------------------------------------------------------

ParseCheck = Callable[[str, list[Flag]], dict]


def vllm_check(release: str, vllm_path: str | None) -> ParseCheck:
    """A check that runs this script's --parse-worker in a child process (vllm_path first on PYTHONPATH)."""

    def check(model: str, flags: list[Flag]) -> dict:
        env = dict(os.environ)
        if vllm_path:
            env["PYTHONPATH"] = os.pathsep.join([vllm_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        request = {"release": release, "model": model, "groups": [f.words for f in flags]}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--parse-worker"],
                              input=json.dumps(request), env=env, capture_output=True, text=True, check=False,
                              timeout=900)
        answers = [ln for ln in proc.stdout.splitlines() if ln.startswith(WORKER_TAG)]
        if proc.returncode != 0 or not answers:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": f"the vLLM parser check failed in {sys.executable}: {tail}"}
        return json.loads(answers[-1][len(WORKER_TAG):])

    return check


def _jsonable(value):
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    return getattr(value, "name", None) or str(value)


def _parse_worker() -> int:
    """Child process: parse each option group, then the whole command, with this interpreter's vLLM."""
    request = json.load(sys.stdin)
    try:
        import vllm
    except ImportError:
        answer = {"usage": f"vLLM is not importable by {sys.executable}; run the importer in .venv-vllm or "
                           f"inside the variant's image (see --help)"}
        print(WORKER_TAG + json.dumps(answer))
        return 0
    if vllm.__version__ != request["release"]:
        answer = {"usage": f"this interpreter has vLLM {vllm.__version__}, not {request['release']}: pass "
                           f"--vllm-path with that release's tree, or run inside its image"}
        print(WORKER_TAG + json.dumps(answer))
        return 0
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class OneSubcommand:
        """What ServeSubcommand.subparser_init asks of argparse's subparsers action: the `serve` parser,
        built as vLLM's CLI builds it (a FlexibleArgumentParser), which is then used on its own."""

        def add_parser(self, name, help=None, **kwargs):  # noqa: A002 - argparse's own keyword
            return FlexibleArgumentParser(prog=f"vllm {name}", **kwargs)

    serve = ServeSubcommand()
    parser = serve.subparser_init(OneSubcommand())
    actions = parser._option_string_actions
    model = request["model"]

    def parse(words):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                return parser.parse_args([model, *words]), None
        except SystemExit:
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            message = lines[-1] if lines else "rejected by the parser"
            return None, message.split("error: ", 1)[-1]

    base, _ = parse([])
    base_vars = vars(base)
    groups = []
    for words in request["groups"]:
        name = words[0].split("=", 1)[0]
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-").split(".", 1)[0]
        action = actions.get(name)
        canonical = name if name.startswith("--") or action is None else next(
            (o for o in action.option_strings if o.startswith("--")), name)
        args, error = parse(words)
        changed = {} if args is None else {k: _jsonable(v) for k, v in vars(args).items()
                                           if k not in ("model_tag", "model") and base_vars.get(k) != v}
        groups.append({"option": canonical, "known": action is not None, "changed": changed, "error": error})
    whole_error = None
    args, error = parse([w for words in request["groups"] for w in words])
    if error:
        whole_error = error
    else:
        try:
            serve.validate(args)
            args.model = args.model_tag or args.model
            AsyncEngineArgs.from_cli_args(args)
        except Exception as exc:  # noqa: BLE001 - reported as the command's refusal
            whole_error = f"{type(exc).__name__}: {exc}"
    answer = {"version": vllm.__version__, "groups": groups, "whole_error": whole_error}
    print(WORKER_TAG + json.dumps(answer))
    return 0


# --- mapping to a catalogue entry ---------------------------------------------------------------------------

def load_methods_yml(path: Path = METHODS_YML) -> dict:
    """group_vars/all/methods.yml (spark_method_catalogue, spark_vllm_variants), as the deploy reads it."""
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_variants(path: Path = METHODS_YML) -> dict[str, str]:
    """vLLM version -> spark_vllm_variants key (group_vars/all/methods.yml)."""
    variants = load_methods_yml(path)["spark_vllm_variants"]
    return {str(v["version"]): k for k, v in variants.items()}


def our_image_repo(path: Path = BUILD_DEFAULTS) -> str:
    return str(yaml.safe_load(path.read_text(encoding="utf-8"))["vllm_build_image_repo"])


def _slug(text: str) -> str:
    """A catalogue name (spark_models._NAME_RE: lower case, digits, . _ -, at most 64, no leading . or -)."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")[:64].rstrip("-.") or "model"


# What vLLM runs with when a recipe does not pass one of the model's options ('' = the option is not rendered,
# vLLM's own default; None = unknown, which the deploy refuses until the owner fills it in: the toolkit always
# passes a context length, and enables tool calls by default, so it needs the tool parser).
WHEN_ABSENT = {
    "--reasoning-parser": "",    # no reasoning parsing
    "--load-format": "",         # vLLM's default loader
    "--max-model-len": None,     # vLLM derives it from the checkpoint's config
    "--tool-call-parser": None,
}


def _model_serve(serve: dict, name: str, line: int, not_applied: list[dict]) -> dict:
    """The entry's serve: exactly the model's own settings (spark_models.SERVE_KEYS). A knob of the
    recipe that is not one of them is the owner's: recorded in ``not_applied`` as the inventory line to
    set; a setting the recipe does not pass is what vLLM runs with without it (WHEN_ABSENT), the served
    name the entry's, and the INT8 head off (our patch is keyed to the 122B's head)."""
    absent = {spark_methods._MANAGED_OPTIONS[option]: value for option, value in WHEN_ABSENT.items()}
    out = {}
    for knob in spark_models.SERVE_KEYS:
        if knob in serve:
            out[knob] = serve[knob]
        elif knob == "vllm_served_model_name":
            out[knob] = name
        elif knob in absent:
            out[knob] = absent[knob]
        else:  # vllm_lm_head_int8: no vLLM option; off
            out[knob] = False
    for knob, value in serve.items():
        if knob not in spark_models.SERVE_KEYS:
            not_applied.append({"option": knob, "value": json.dumps(value), "line": line,
                                "reason": f"not a setting of the model: set {knob}: {json.dumps(value)} in "
                                          f"the inventory (group_vars) to serve it as the recipe does"})
    return out


def _not_applied(flag: Flag, reason: str, value: str | None = None) -> dict:
    return {"option": flag.option, "value": " ".join(flag.words[1:]) if value is None else value,
            "line": flag.line, "reason": reason}


def _spec_methods(config, flag: Flag | None, serve: dict, not_applied: list[dict],
                  catalogue: Mapping) -> tuple[dict, list[Refusal]]:
    """The entry's methods: baseline (every model serves without speculation) plus the recipe's
    --speculative-config method, in the schema's shape ({} or {drafter, drafter_revision}). Its other keys
    go to the knob methods.yml's setting_overrides names for them (into ``serve``), are dropped where the
    method catalogue renders the same value, and are recorded in ``not_applied`` otherwise."""
    methods: dict = {"baseline": {}}
    if not config or flag is None:
        return methods, []
    if not isinstance(config, Mapping):
        return methods, [Refusal(flag.line, f"--speculative-config {config!r} is not a JSON object")]
    raw = str(config.get("method") or "")
    # a *_mtp method files as mtp: vLLM does the same (0.19.1 vllm/config/speculative.py:367-371)
    name = "mtp" if "mtp" in raw else raw
    if name not in catalogue:
        return methods, [Refusal(flag.line, f"--speculative-config method {raw!r} is not in the method "
                                 f"catalogue ({', '.join(catalogue)}; group_vars/all/methods.yml): add the "
                                 f"method there first, or drop --speculative-config to import the model "
                                 f"alone")]
    spec: dict = {}
    overrides = catalogue[name].get("setting_overrides") or {}
    defaults = catalogue[name].get("speculative_config") or {}
    for key, value in config.items():
        knob = overrides.get(key)
        if key == "method":
            continue
        if key == "model" and name in spark_models.DRAFTER_KNOBS:
            spec["drafter"] = value
        elif key == "revision" and name in spark_models.DRAFTER_KNOBS:
            spec["drafter_revision"] = value
        elif knob in spark_methods.SETTING_DEFAULTS:
            serve[knob] = value
        elif key in defaults and defaults[key] == value:
            continue
        else:
            ours = (f"renders {key}={json.dumps(defaults[key])}" if key in defaults
                    else f"does not render {key}")
            not_applied.append(_not_applied(flag, f"no knob sets speculative_config.{key}; the method "
                                            f"catalogue's {name} {ours}", f"{key}={json.dumps(value)}"))
    methods[name] = spec
    return methods, []


def _knob_value(option: str, changed: dict):
    """The knob value of a managed option from the dests the parser set."""
    if option == "--served-model-name":
        names = changed.get("served_model_name") or []
        return names[0] if isinstance(names, list) and len(names) == 1 else names
    if option in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        return bool(changed.get("enable_prefix_caching", option.startswith("--enable")))
    if option in ("--enable-auto-tool-choice", "--no-enable-auto-tool-choice"):
        return bool(changed.get("enable_auto_tool_choice", option.startswith("--enable")))
    values = list(changed.values())
    return values[0] if len(values) == 1 else None


def build_entry(recipe: Recipe, model: str, model_line: int, flags: list[Flag], answer: dict, *, release: str,
                variant: str, image_repo: str, replace_container: bool = False,
                revision: str | None = None,
                methods_yml: Mapping | None = None) -> tuple[dict, list[Refusal]]:
    """The catalogue entry of a parsed recipe ({} when refused), and every reason to refuse it. The entry is
    one that filter_plugins/spark_models.py ``spark_model_entry_errors`` accepts; its name is its model_dir.
    ``methods_yml``: group_vars/all/methods.yml as loaded (read from the repository when None)."""
    doc, lines = recipe.doc, recipe.lines
    methods_yml = load_methods_yml() if methods_yml is None else methods_yml
    method_catalogue = methods_yml["spark_method_catalogue"]
    refusals: list[Refusal] = []
    container = doc.get("container")
    if container and not str(container).startswith(image_repo) and not replace_container:
        refusals.append(Refusal(lines["container"], f"container {container!r} is not an image this toolkit "
                                f"builds ({image_repo}:<tag>); pass --replace-container to serve it with our "
                                f"{variant} build instead"))
    if doc.get("build_args") and not replace_container:
        refusals.append(Refusal(lines["build_args"], "build_args configure the recipe's own image build; "
                                "pass --replace-container to serve it with our build instead"))
    if doc.get("mods"):
        refusals.append(Refusal(lines["mods"], "mods patch the recipe's container at start; our images carry "
                                "their patches in patches/vllm-<version>/: port the fix there first"))
    if doc.get("cluster_only"):
        refusals.append(Refusal(lines["cluster_only"], "cluster_only: a catalogue entry serves on one Spark; "
                                "the cluster stage adds the nodes"))
    env = {}
    for name, value in (doc.get("env") or {}).items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if (not spark_methods._ENV_NAME_RE.fullmatch(str(name))
                or not spark_methods._ENV_VALUE_RE.fullmatch(text)):
            refusals.append(Refusal(lines.get(f"env.{name}", lines["env"]), f"env {name}={text!r}: the "
                                    f"server environment takes upper-case names and plain values (letters, "
                                    f"digits, _ . , : / = + -)"))
        else:
            env[str(name)] = text
    if answer.get("error"):
        return {}, refusals + [Refusal(recipe.command_line, answer["error"])]
    serve: dict = {}
    spec_config, spec_flag = None, None
    extra: list[str] = []
    not_applied: list[dict] = []
    flag_knobs = {opt: key for key, opt in spark_methods._FLAG_OPTIONS.items()}
    for flag, got in zip(flags, answer["groups"], strict=True):
        flag.option, flag.changed, flag.error = got["option"], got["changed"], got["error"]
        option = flag.option
        if not got["known"]:
            refusals.append(Refusal(flag.line, f"{flag.words[0]}: vLLM {release} has no such option"))
            continue
        if flag.error:
            refusals.append(Refusal(flag.line, f"{' '.join(flag.words)}: vLLM {release} refuses it: "
                                    f"{flag.error}"))
            continue
        knob = spark_methods._MANAGED_OPTIONS.get(option)
        if option in DEPLOYMENT_OPTIONS:
            not_applied.append(_not_applied(flag, f"where the server listens is the owner's ({knob})"))
        elif option in REFUSED_OPTIONS:
            refusals.append(Refusal(flag.line, f"{option}: {REFUSED_OPTIONS[option]}"))
        elif option == "--tensor-parallel-size":
            tp = flag.changed.get("tensor_parallel_size", 1)
            if tp != 1:
                refusals.append(Refusal(flag.line, f"{option} {tp}: a catalogue entry serves on one Spark; "
                                        f"spark_tensor_parallel_size is the cluster stage's"))
            else:
                not_applied.append(_not_applied(flag, "one Spark: the toolkit's default", "1"))
        elif knob == "the cluster stage":
            refusals.append(Refusal(flag.line, f"{option}: multi-node options are the cluster stage's"))
        elif option == "--speculative-config":
            spec_config, spec_flag = flag.changed.get("speculative_config"), flag
        elif option == "--mamba-cache-mode":
            not_applied.append(_not_applied(flag, "the toolkit renders it with prefix caching "
                                            "(vllm_enable_prefix_caching, methods.yml prefix_caching)"))
        elif option == "--attention-backend":
            serve["vllm_attention_backend"] = _knob_value(option, flag.changed)
        elif option in flag_knobs:
            not_applied.append(_not_applied(flag, f"methods.yml sets it per method (serve_flags."
                                            f"{flag_knobs[option]}); no knob of main.yml takes it"))
        elif knob in spark_methods.SETTING_DEFAULTS:
            serve[knob] = _knob_value(option, flag.changed)
        elif knob is not None:
            refusals.append(Refusal(flag.line, f"{option} is set by the toolkit ({knob}); no knob takes it "
                                    f"from a recipe"))
        elif option in FILE_OPTIONS:
            refusals.append(Refusal(flag.line, f"{' '.join(flag.words)}: names a file of the recipe's "
                                    f"container, which our image does not have; the checkpoint's own "
                                    f"template serves"))
        else:
            extra += flag.words
    parser_refused = any(not g["known"] or g["error"] for g in answer["groups"])
    if answer.get("whole_error") and not parser_refused:
        refusals.append(Refusal(recipe.command_line, f"vLLM {release} refuses the command as a whole: "
                                f"{answer['whole_error']}"))
    if isinstance(serve.get("vllm_served_model_name"), list):
        refusals.append(Refusal(recipe.command_line, "--served-model-name gives several names; the toolkit "
                                "serves one"))
    errors: list[str] = []
    spark_methods._check_extra_args(errors, extra)
    refusals += [Refusal(recipe.command_line, e) for e in errors]
    if revision is not None and not (revision == "main" or spark_models._COMMIT_RE.fullmatch(revision)):
        refusals.append(Refusal(model_line, f"--revision {revision!r} is not a commit SHA (40 lower-case "
                                f"hex) or main: the catalogue pins a checkpoint by its commit"))
    repo = doc.get("model") or model
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(repo)):
        refusals.append(Refusal(lines.get("model", model_line), f"model {repo!r} is not a Hugging Face repo "
                                f"id; a catalogue entry fetches its checkpoint from the Hub (org/name)"))
    methods, spec_refusals = _spec_methods(spec_config, spec_flag, serve, not_applied, method_catalogue)
    refusals += spec_refusals
    name = _slug(str(doc.get("name") or str(repo).split("/")[-1]))
    serve = _model_serve(serve, name, recipe.command_line, not_applied)
    description = doc.get("description") or (doc.get("metadata") or {}).get("description")
    entry = {
        "description": str(description or f"{repo}, imported from {Path(recipe.path).name}"),
        "imported_from": {"recipe": recipe.path, "recipe_version": str(doc.get("recipe_version", "1")),
                          "container": container, "checked_by": f"vLLM {release} argument parser"},
        # revision main: model_fetch resolves it to its commit at the first fetch and records it
        "checkpoints": [{"role": "checkpoint", "repo": str(repo), "revision": revision or "main",
                         "mode": "full"}],
        "assembly": "none",
        "model_dir": name,
        # null = unknown: the deploy refuses the model until the owner fills in the size (spark_model_errors)
        "sizes": {"disk_bytes": {"checkpoint": None}, "memory_bytes": None},
        "serve": serve,
        "server_env": env,
        "extra_args": extra,
        "methods": methods,
        "vllm_variant": variant,
        "not_applied": not_applied,
    }
    if not refusals:
        errors = spark_models.spark_model_entry_errors(name, entry, method_catalogue,
                                                       methods_yml["spark_vllm_variants"])
        refusals += [Refusal(recipe.command_line, f"the entry fails the catalogue's check: {e}")
                     for e in errors]
    return ({} if refusals else entry), refusals


def import_recipe(text: str, path: str, check: ParseCheck, **kwargs) -> tuple[dict, list[Refusal]]:
    """Recipe text -> (entry, refusals). RecipeError's refusals come back as refusals."""
    try:
        recipe = read_recipe(text, path)
        model, model_line, flags = parse_command(recipe.command_lines, recipe.command_line)
    except RecipeError as exc:
        return {}, exc.refusals
    answer = check(model, flags)
    if answer.get("usage"):
        raise UsageError(answer["usage"])
    return build_entry(recipe, model, model_line, flags, answer, **kwargs)


# --- command line -------------------------------------------------------------------------------------------

def build_parser(releases: list[str]) -> argparse.ArgumentParser:
    parser = doc_parser("recipe_import.py", __doc__)
    parser.add_argument("recipe", help="the recipe YAML file")
    parser.add_argument("--release", choices=releases, default=releases[0],
                        help="the vLLM release (and so our variant) that will serve it (default %(default)s)")
    parser.add_argument("--out", help="write the entry here (atomically); default: stdout")
    parser.add_argument("--vllm-path", help="a vLLM tree put first on PYTHONPATH for the check (default: "
                        ".cache/vllm-<release>-py when it exists)")
    parser.add_argument("--revision", help="pin the checkpoint to this Hub revision (a commit SHA)")
    parser.add_argument("--replace-container", action="store_true",
                        help="serve with our build of --release instead of the recipe's container")
    return parser


def _our_entry(path: Path) -> bool:
    """Whether ``path`` holds an entry an earlier import wrote (one name -> a mapping with imported_from):
    only such a file is replaced by --out; anything else is not ours to overwrite."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return (isinstance(doc, dict) and len(doc) == 1
            and isinstance(entry := next(iter(doc.values())), dict) and "imported_from" in entry)


def main(argv: list[str] | None = None, check: ParseCheck | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--parse-worker"]:
        return _parse_worker()
    variants = load_variants()
    parser = build_parser(sorted(variants))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_DONE if exc.code == 0 else EXIT_USAGE
    path = Path(args.recipe)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else exc
        return say_error(TOOL, f"cannot read {path}: {reason}; pass a recipe YAML file", EXIT_USAGE)
    if args.out and not Path(args.out).resolve().parent.is_dir():
        return say_error(TOOL, f"--out {args.out}: its directory does not exist; create it or choose "
                               f"another", EXIT_USAGE)
    if args.out and Path(args.out).exists() and not _our_entry(Path(args.out)):
        return say_error(TOOL, f"--out {args.out}: the file exists and is no entry this tool wrote (no "
                               f"imported_from); it is left as it is: choose another path", EXIT_USAGE)
    vllm_path = args.vllm_path
    default_tree = ROOT / ".cache" / f"vllm-{args.release}-py"
    if vllm_path is None and (default_tree / ".complete").exists():
        vllm_path = str(default_tree)
    try:
        entry, refusals = import_recipe(
            text, str(path), check or vllm_check(args.release, vllm_path), release=args.release,
            variant=variants[args.release], image_repo=our_image_repo(),
            replace_container=args.replace_container, revision=args.revision)
    except UsageError as exc:
        return say_error(TOOL, exc, EXIT_USAGE)
    if refusals:
        for r in sorted(refusals, key=lambda r: r.line):
            print(f"{path}:{r.line}: {r.reason}", file=sys.stderr)
        return EXIT_FAILED
    sha = hashlib.sha256(text.encode()).hexdigest()
    entry["imported_from"]["recipe_sha256"] = sha
    # {name: entry}: pasted under spark_model_catalogue or spark_model_catalogue_local (its name is model_dir)
    out = yaml.safe_dump({entry["model_dir"]: entry}, sort_keys=False, default_flow_style=False, width=110)
    if entry["checkpoints"][0]["revision"] == "main":
        print(f"{TOOL}: note: {entry['checkpoints'][0]['repo']} is not pinned (revision main: the first "
              f"fetch resolves and records its commit); pass --revision <commit> to pin it", file=sys.stderr)
    if args.out:
        write_bytes_atomic(args.out, out.encode())
    else:
        sys.stdout.write(out)
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main())
