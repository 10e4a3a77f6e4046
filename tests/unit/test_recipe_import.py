"""recipe_import without vLLM: reading, substituting, splitting, mapping, refusing, exit codes.

The vLLM parser is replaced by ``fake_check``, a small table of options that answers as the real worker does
(canonical option, the dests it set, the parser's complaint); tests/contract/test_recipe_import_contract.py
runs the same recipes through the real parsers of 0.19.1 and 0.26.0.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import recipe_import as ri
import yaml
from spark_models import spark_model_entry_errors, spark_model_errors

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "tests" / "fixtures" / "recipes"
# the method catalogue and the build variants the deploy checks an entry against (as test_spark_models.py)
METHODS_YML = yaml.safe_load((ROOT / "group_vars" / "all" / "methods.yml").read_text(encoding="utf-8"))
METHOD_CAT = METHODS_YML["spark_method_catalogue"]
VARIANTS = METHODS_YML["spark_vllm_variants"]

# option -> (dest, type): what the fake parser knows; "flag" takes no value, "json" parses JSON.
OPTIONS = {
    "--served-model-name": ("served_model_name", "list"), "--host": ("host", str), "--port": ("port", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float), "--max-model-len": ("max_model_len", int),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int), "--kv-cache-dtype": ("kv_cache_dtype", str),
    "--load-format": ("load_format", str), "--reasoning-parser": ("reasoning_parser", str),
    "--enable-auto-tool-choice": ("enable_auto_tool_choice", "flag"),
    "--tool-call-parser": ("tool_call_parser", str),
    "--enable-prefix-caching": ("enable_prefix_caching", "flag"),
    "--no-enable-prefix-caching": ("enable_prefix_caching", "noflag"),
    "--speculative-config": ("speculative_config", "json"),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--max-num-seqs": ("max_num_seqs", int), "--enforce-eager": ("enforce_eager", "flag"),
    "--api-key": ("api_key", str), "--chat-template": ("chat_template", str),
    "--attention-backend": ("attention_backend", str), "--trust-remote-code": ("trust_remote_code", "flag"),
    "--disable-log-stats": ("disable_log_stats", "flag"), "--nnodes": ("nnodes", int),
}
ALIASES = {"-tp": "--tensor-parallel-size"}


def fake_check(model, flags):
    groups = []
    for flag in flags:
        head, _, inline = flag.words[0].partition("=")
        values = ([inline] if inline else []) + flag.words[1:]
        name = ALIASES.get(head, "--" + head[2:].replace("_", "-") if head.startswith("--") else head)
        if name not in OPTIONS:
            groups.append({"option": name, "known": False, "changed": {}, "error": None})
            continue
        dest, kind = OPTIONS[name]
        error, value = None, None
        try:
            if kind in ("flag", "noflag"):
                if values:
                    raise ValueError(f"unrecognized arguments: {' '.join(values)}")
                value = kind == "flag"
            elif len(values) != 1 and kind != "list":
                raise ValueError(f"argument {name}: expected one argument")
            elif kind == "list":
                value = values
            elif kind == "json":
                value = json.loads(values[0])
            else:
                value = kind(values[0])
        except ValueError as exc:
            error = str(exc)
        changed = {} if error else {dest: value}
        groups.append({"option": name, "known": True, "changed": changed, "error": error})
    return {"version": "0.19.1", "groups": groups, "whole_error": None}


KW = {"release": "0.19.1", "variant": "v0_19_1", "image_repo": "sparkllm/vllm"}


def run(text: str, **kwargs):
    return ri.import_recipe(text, "r.yaml", fake_check, **{**KW, **kwargs})


def lines_of(refusals):
    return sorted(r.line for r in refusals)


GOOD = """\
recipe_version: "2"
model: Qwen/Qwen3.6-35B-A3B-FP8
container: sparkllm/vllm
defaults:
  port: 8000
  spec: '{"method": "qwen3_next_mtp", "num_speculative_tokens": 3}'
env:
  VLLM_MARLIN_USE_ATOMIC_ADD: 1
command: |
  vllm serve {model} \\
    --port {port} --host 0.0.0.0 \\
    --served-model-name q36 \\
    --max-model-len 65536 \\
    --max-num-batched-tokens 4096 \\
    --kv-cache-dtype fp8 \\
    --enable-prefix-caching \\
    --speculative-config '{spec}'
"""


def test_a_recipe_maps_flags_to_knobs_methods_and_extra_args():
    entry, refusals = run(GOOD)
    assert refusals == []
    # not pinned: main, which model_fetch resolves and records at the first fetch
    assert entry["checkpoints"] == [{"role": "checkpoint", "repo": "Qwen/Qwen3.6-35B-A3B-FP8",
                                     "revision": "main", "mode": "full"}]
    assert entry["assembly"] == "none" and entry["vllm_variant"] == "v0_19_1"
    assert "name" not in entry and entry["model_dir"] == "qwen3.6-35b-a3b-fp8"
    assert entry["sizes"] == {"disk_bytes": {"checkpoint": None}, "memory_bytes": None}
    # serve holds exactly the model's own settings (spark_models.SERVE_KEYS): the recipe's, else what it ran
    # with (no --reasoning-parser: ''), else unknown (null, refused at deploy until filled in)
    assert entry["serve"] == {"vllm_served_model_name": "q36", "vllm_max_model_len": 65536,
                              "vllm_reasoning_parser": "", "vllm_tool_call_parser": None,
                              "vllm_load_format": "", "vllm_lm_head_int8": False}
    assert entry["methods"] == {"baseline": {}, "mtp": {}}
    assert entry["extra_args"] == ["--kv-cache-dtype", "fp8"]
    assert entry["server_env"] == {"VLLM_MARLIN_USE_ATOMIC_ADD": "1"}
    # knobs of the owner's (prefix caching; num_speculative_tokens, methods.yml mtp setting_overrides) are
    # recorded as the inventory lines to set, at the command's line
    assert [(n["option"], n["line"]) for n in entry["not_applied"]] == [
        ("--port", 11), ("--host", 11), ("--max-num-batched-tokens", 14),
        ("vllm_enable_prefix_caching", 10), ("spec_num_speculative_tokens", 10)]
    assert "serve_flags.max_num_batched_tokens" in entry["not_applied"][2]["reason"]
    assert "set spec_num_speculative_tokens: 3 in the inventory" in entry["not_applied"][4]["reason"]
    assert spark_model_entry_errors("qwen3.6-35b-a3b-fp8", entry, METHOD_CAT, VARIANTS) == []


def test_a_recipe_without_speculation_is_a_baseline_entry():
    entry, refusals = run('command: "vllm serve Qwen/Qwen3-8B --max-model-len 4096 --trust-remote-code"\n')
    assert refusals == []
    assert entry["methods"] == {"baseline": {}}
    assert entry["extra_args"] == ["--trust-remote-code"]
    assert entry["description"] == "Qwen/Qwen3-8B, imported from r.yaml"


def spec_recipe(config: str) -> str:
    """A recipe whose --speculative-config (line 5) is ``config``, kept in defaults as recipes do."""
    return (f"defaults:\n  spec: '{config}'\n"
            "command: |\n  vllm serve o/m \\\n    --speculative-config '{spec}'\n")


def test_speculative_settings_go_to_knobs_drafters_or_not_applied():
    entry, refusals = run(spec_recipe('{"method": "ngram", "num_speculative_tokens": 4, '
                                      '"prompt_lookup_min": 2, "prompt_lookup_max": 6, '
                                      '"disable_by_batch_size": 8}'))
    assert refusals == []
    assert entry["methods"] == {"baseline": {}, "ngram": {}}
    assert [(n["option"], n["value"]) for n in entry["not_applied"][1:]] == [
        ("spec_num_speculative_tokens", "4"), ("spec_ngram_lookup_min", "2"), ("spec_ngram_lookup_max", "6")]
    note = entry["not_applied"][0]
    assert (note["option"], note["value"], note["line"]) == ("--speculative-config",
                                                             "disable_by_batch_size=8", 5)
    assert "does not render disable_by_batch_size" in note["reason"]
    entry, refusals = run(spec_recipe('{"method": "eagle3", "model": "o/d", "revision": "' + "c" * 40 + '"}'))
    assert refusals == []
    assert entry["methods"] == {"baseline": {}, "eagle3": {"drafter": "o/d", "drafter_revision": "c" * 40}}
    assert entry["serve"]["vllm_served_model_name"] == "m" and entry["not_applied"] == []
    assert spark_model_entry_errors("m", entry, METHOD_CAT, VARIANTS) == []


def test_a_speculative_method_the_catalogue_lacks_is_refused_at_its_line():
    entry, refusals = run(spec_recipe('{"method": "suffix", "num_speculative_tokens": 4}'))
    assert entry == {} and lines_of(refusals) == [5]
    assert "'suffix' is not in the method catalogue" in refusals[0].reason


def test_an_entry_the_catalogues_check_refuses_is_never_written():
    methods_yml = {**METHODS_YML, "spark_vllm_variants": {"v9": {}}}
    entry, refusals = run("command: vllm serve o/m\n", methods_yml=methods_yml)
    assert entry == {}
    assert ["vllm_variant='v0_19_1' is not a build variant" in r.reason for r in refusals] == [True]


@pytest.mark.parametrize(("text", "line", "words"), [
    ("a: [1\n", 2, "not valid YAML"),
    ("- a\n- b\n", 1, "a YAML mapping"),
    ("command: vllm serve m/x\nimage: x\n", 2, "unknown recipe key 'image'"),
    ("recipe_version: '3'\ncommand: vllm serve m/x\n", 1, "recipe_version '3'"),
    ("runtime: sglang\ncommand: vllm serve m/x\n", 1, "only vllm recipes"),
    ("defaults: [1]\ncommand: vllm serve m/x\n", 1, "defaults must be a mapping"),
    ("model: m/x\n", 1, "command is missing"),
])
def test_malformed_recipes_are_refused_with_their_line(text, line, words):
    entry, refusals = run(text)
    assert entry == {}
    assert [r.line for r in refusals] == [line]
    assert words in refusals[0].reason


def test_placeholders_take_defaults_and_model_once():
    recipe = ri.read_recipe('model: o/m\ndefaults:\n  j: \'{"a": 1}\'\ncommand: |\n  vllm serve {model} '
                            '--speculative-config \'{j}\' --x {{y}}\n')
    assert recipe.command_line == 5
    # one pass, as str.format: the JSON of a default is not read again; {{ }} are literal braces
    assert recipe.command_lines == ['vllm serve o/m --speculative-config \'{"a": 1}\' --x {y}']


def test_an_undefined_placeholder_is_refused_at_its_line():
    _, refusals = run("defaults: {a: 1}\ncommand: |\n  vllm serve o/m \\\n    --port {a} \\\n    --x {b}\n")
    assert lines_of(refusals) == [5]
    assert "{b}" in refusals[0].reason


def test_words_carry_the_line_they_start_on():
    words = ri.split_command(["vllm serve o/m \\", "  --speculative-config '{\"method\":", "  \"mtp\"}' \\",
                              "  --port 1"], 10)
    assert words[3:5] == [("--speculative-config", 11), ('{"method":\n  "mtp"}', 11)]
    assert words[-2:] == [("--port", 13), ("1", 13)]


@pytest.mark.parametrize(("lines", "words"), [
    (["vllm serve o/m --port $PORT"], "shell expansion"),
    (["vllm serve o/m `x`"], "shell expansion"),
    (["vllm serve o/m --port 1 ; echo"], "shell operator"),
    (["vllm serve o/m --port 1 | tee log"], "shell operator"),
    (["vllm serve o/m --x 'a"], "unbalanced quote"),
])
def test_shell_the_importer_cannot_run_is_refused(lines, words):
    with pytest.raises(ri.RecipeError) as exc:
        ri.split_command(lines, 4)
    assert words in exc.value.refusals[0].reason and exc.value.refusals[0].line == 4


def test_parse_command_groups_options_and_finds_the_model():
    model, line, flags = ri.parse_command(["vllm serve \\", "  --model o/m --seed -1 --max-model-len=4 \\",
                                           "  --enforce-eager"], 3)
    assert (model, line) == ("o/m", 4)
    assert [(f.words, f.line) for f in flags] == [(["--seed", "-1"], 4), (["--max-model-len=4"], 4),
                                                  (["--enforce-eager"], 5)]


@pytest.mark.parametrize(("lines", "words"), [
    (["HF_HOME=/x vllm serve o/m"], "put environment variables under env"),
    (["python -m vllm.entrypoints.openai.api_server --model o/m"], "does not start with `vllm serve`"),
    (["vllm serve --port 1"], "names no model"),
    (["vllm serve o/m extra"], "stray word"),
])
def test_commands_that_are_not_one_vllm_serve_are_refused(lines, words):
    with pytest.raises(ri.RecipeError) as exc:
        ri.parse_command(lines, 1)
    assert words in exc.value.refusals[0].reason


def test_unknown_options_and_bad_values_are_refused_with_their_lines():
    _, refusals = run("command: |\n  vllm serve o/m \\\n    --no-such 1 \\\n    --max-num-seqs many\n")
    assert lines_of(refusals) == [3, 4]
    assert "has no such option" in refusals[0].reason and "refuses it" in refusals[1].reason


def test_options_the_toolkit_owns_are_refused():
    text = ("command: |\n  vllm serve o/m \\\n    --tensor-parallel-size 2 \\\n    --api-key k \\\n"
            "    --disable-log-stats \\\n    --nnodes 2 \\\n    --chat-template t.jinja\n")
    _, refusals = run(text)
    assert lines_of(refusals) == [3, 4, 5, 6, 7]
    assert not any(" k " in r.reason for r in refusals)  # the key is not echoed


def test_tensor_parallel_one_is_accepted_and_any_chat_template_file_refused():
    entry, refusals = run("command: vllm serve o/m -tp 1\n")
    assert refusals == [] and entry["not_applied"][0]["option"] == "--tensor-parallel-size"
    _, refusals = run("command: vllm serve o/m -tp 1 --chat-template /opt/t.jinja\n")
    assert "names a file of the recipe's container" in refusals[0].reason


def test_a_foreign_container_is_refused_unless_replaced_and_mods_always():
    text = ("container: vllm-node\nmods: [mods/x]\nbuild_args: [--pre-tf]\n"
            "command: vllm serve o/m --max-model-len 8\n")
    _, refusals = run(text)
    assert lines_of(refusals) == [1, 2, 3]
    entry, refusals = run(text, replace_container=True)
    assert lines_of(refusals) == [2]  # mods patch their container: never imported
    entry, refusals = run(text.replace("mods: [mods/x]\n", ""), replace_container=True)
    assert refusals == [] and entry["imported_from"]["container"] == "vllm-node"


def test_server_env_is_checked_like_the_catalogues():
    _, refusals = run("env:\n  ok_lower: 1\n  GOOD: 'a b'\ncommand: vllm serve o/m\n")
    assert lines_of(refusals) == [2, 3]


def test_a_local_model_path_without_a_hub_repo_is_refused():
    _, refusals = run("command: vllm serve /home/me/models/x\n")
    assert "not a Hugging Face repo id" in refusals[0].reason
    entry, refusals = run("model: o/x\ncommand: vllm serve /home/me/models/x\n")
    assert refusals == [] and entry["checkpoints"][0]["repo"] == "o/x"


@pytest.mark.parametrize("revision", ["a" * 40, "main"])
def test_a_revision_pins_the_checkpoint(revision):
    entry, refusals = run("command: vllm serve o/m\n", revision=revision)
    assert refusals == [] and entry["checkpoints"][0]["revision"] == revision


@pytest.mark.parametrize("revision", ["..", "v1.0", "A" * 40, "a" * 39])
def test_a_revision_that_is_no_commit_or_main_is_refused(revision):
    # the catalogue's schema takes a 40-hex commit or main (filter_plugins/spark_models.py)
    _, refusals = run("command: vllm serve o/m\n", revision=revision)
    assert ["not a commit SHA" in r.reason for r in refusals] == [True]


def test_a_worker_without_the_release_is_a_usage_error():
    with pytest.raises(ri.UsageError, match="not 0.19.1"):
        ri.import_recipe("command: vllm serve o/m\n", "r", lambda m, f: {"usage": "vLLM 0.26.0, not 0.19.1"},
                         **KW)


# --- the fixtures -------------------------------------------------------------------------------------------

def expected_lines(path: Path) -> list[int]:
    head = "".join(ln for ln in path.read_text().splitlines(keepends=True) if ln.startswith("#"))
    return sorted(int(n) for n in re.findall(r"line (\d+)", head))


@pytest.mark.parametrize("path", sorted(RECIPES.glob("bad-*.yaml")), ids=lambda p: p.stem)
def test_bad_fixtures_are_refused_at_the_lines_they_name(path):
    entry, refusals = ri.import_recipe(path.read_text(), str(path), fake_check, **KW)
    assert entry == {}
    assert lines_of(refusals) == expected_lines(path), [r.reason for r in refusals]


@pytest.mark.parametrize("path", sorted(RECIPES.glob("good-*.yaml")), ids=lambda p: p.stem)
def test_good_fixtures_import(path):
    entry, refusals = ri.import_recipe(path.read_text(), str(path), fake_check, **KW)
    assert refusals == [], [(r.line, r.reason) for r in refusals]
    assert entry["checkpoints"][0]["repo"].count("/") == 1


@pytest.mark.parametrize("path", sorted(RECIPES.glob("good-*.yaml")), ids=lambda p: p.stem)
def test_good_fixtures_are_entries_the_deploy_accepts_once_sized(path):
    """The written entry passes the catalogue's check; the deploy refuses it only for what the recipe did not
    say: its size, and a model setting it does not pass (the tool parser here: null until filled in)."""
    entry, _ = ri.import_recipe(path.read_text(), str(path), fake_check, **KW)
    name = entry["model_dir"]
    assert spark_model_entry_errors(name, entry, METHOD_CAT, VARIANTS) == []
    assert "baseline" in entry["methods"]
    for method in entry["methods"]:
        errs = spark_model_errors(name, {name: entry}, method, METHOD_CAT, VARIANTS)
        assert any("sizes.disk_bytes checkpoint null" in e for e in errs), errs
        assert all("sizes.disk_bytes" in e or "unknown (null); fill them in" in e for e in errs), errs
    sized = {**entry, "sizes": {"disk_bytes": {"checkpoint": 16_000_000_000}, "memory_bytes": None},
             "serve": {**entry["serve"], "vllm_tool_call_parser": "hermes",
                       "vllm_max_model_len": entry["serve"]["vllm_max_model_len"] or 4096}}
    assert spark_model_errors(name, {name: sized}, "baseline", METHOD_CAT, VARIANTS) == []


# --- the command line ---------------------------------------------------------------------------------------

def test_main_writes_the_entry_atomically(tmp_path, capsys):
    out = tmp_path / "entry.yml"
    recipe = RECIPES / "good-qwen3.6-35b-a3b-fp8-mtp.yaml"
    assert ri.main([str(recipe), "--out", str(out), "--revision", "a" * 40], check=fake_check) == ri.EXIT_DONE
    # a second import replaces the entry the first one wrote
    rc = ri.main([str(recipe), "--out", str(out), "--revision", "b" * 40], check=fake_check)
    assert rc == ri.EXIT_DONE
    doc = yaml.safe_load(out.read_text())
    (name, entry), = doc.items()
    assert name == entry["model_dir"] == "qwen3.6-35b-a3b-fp8" and "name" not in entry
    assert spark_model_entry_errors(name, entry, METHOD_CAT, VARIANTS) == []
    assert entry["checkpoints"][0]["revision"] == "b" * 40
    assert len(entry["imported_from"]["recipe_sha256"]) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.yml"]  # no temporary left beside it


def test_main_notes_an_unpinned_checkpoint_on_stderr(capsys):
    assert ri.main([str(RECIPES / "good-dense-plain.yaml")], check=fake_check) == ri.EXIT_DONE
    captured = capsys.readouterr()
    (name, entry), = yaml.safe_load(captured.out).items()
    assert name == "qwen3-8b-plain" and entry["checkpoints"][0]["revision"] == "main"
    assert "Qwen/Qwen3-8B is not pinned" in captured.err and "--revision <commit>" in captured.err


@pytest.mark.parametrize("content", ["old", "other: {name: x}\n", "a: 1\nb: 2\n"])
def test_main_never_replaces_a_file_it_did_not_write(tmp_path, capsys, content):
    out = tmp_path / "entry.yml"
    out.write_text(content)
    recipe = RECIPES / "good-qwen3.6-35b-a3b-fp8-mtp.yaml"
    assert ri.main([str(recipe), "--out", str(out)], check=fake_check) == ri.EXIT_USAGE
    assert out.read_text() == content
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no entry this tool wrote" in err[0]


def test_main_refuses_with_one_line_per_reason_and_exit_1(tmp_path, capsys):
    path = RECIPES / "bad-foreign-container.yaml"
    out = tmp_path / "entry.yml"
    assert ri.main([str(path), "--out", str(out)], check=fake_check) == ri.EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert [ln.split(":")[1] for ln in err] == ["5", "6", "8"]
    assert all(ln.startswith(f"{path}:") for ln in err)
    assert not out.exists()


@pytest.mark.parametrize("argv", [[], ["--release", "0.1.0", "x.yaml"], ["/no/such/recipe.yaml"],
                                  [str(RECIPES / "good-dense-plain.yaml"), "--out", "/no/such/dir/e.yml"]])
def test_usage_errors_exit_2(argv, capsys):
    assert ri.main(argv, check=fake_check) == ri.EXIT_USAGE
    assert "Traceback" not in capsys.readouterr().err


def test_help_says_where_it_runs(capsys):
    assert ri.main(["--help"], check=fake_check) == ri.EXIT_DONE
    text = capsys.readouterr().out
    assert ".venv-vllm" in text and "docker run" in text and "0.26.0" in text


def test_releases_are_the_variants_of_methods_yml():
    assert ri.load_variants() == {"0.19.1": "v0_19_1", "0.26.0": "v0_26_dflash"}
