"""Roles against the one source of each list: method choices come from the catalogue, and every
option of a role's argument specs is documented in its README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p for p in (ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file())


def catalogue_methods() -> list[str]:
    doc = yaml.safe_load((ROOT / "group_vars" / "all" / "methods.yml").read_text())
    return list(doc["spark_method_catalogue"])


def spec_options(role: Path) -> dict[str, dict]:
    """Every option of every entry point of the role (main, and any other)."""
    doc = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())
    options: dict[str, dict] = {}
    for entry in doc["argument_specs"].values():
        options.update(entry.get("options") or {})
    return options


def test_roles_found() -> None:
    assert len(ROLES) >= 9, [r.name for r in ROLES]


def test_spec_method_choices_are_generated_from_the_catalogue() -> None:
    """Every spec_method choices line is the generator's (scripts/role_docs.py writes it from the
    catalogue; role_docs --check, run below, fails when one is stale)."""
    import role_docs

    methods = catalogue_methods()
    assert len(methods) >= 5
    seen = []
    for role in ROLES:
        opt = spec_options(role).get("spec_method")
        if opt is None:
            continue
        seen.append(role.name)
        assert opt.get("choices") == methods, f"roles/{role.name}: run scripts/role_docs.py"
        text = (role / "meta" / "argument_specs.yml").read_text()
        lines = [line for line in text.splitlines() if line.strip().startswith("choices:")
                 and set(methods) & set(yaml.safe_load(line)["choices"])]
        assert lines and all(role_docs.METHODS_MARK in line for line in lines), (
            f"roles/{role.name}/meta/argument_specs.yml: a choices line naming methods lacks the marker "
            f"{role_docs.METHODS_MARK!r}, so the generator would not keep it equal to the catalogue"
        )
    assert {"serve", "bench", "spark_ops", "spark_monitoring"} <= set(seen), seen  # the test checks something


def test_role_docs_rewrites_stale_method_choices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    import role_docs

    role = tmp_path / "roles" / "bench"
    shutil.copytree(ROOT / "roles" / "bench", role)
    spec = role / "meta" / "argument_specs.yml"
    text = spec.read_text()
    stale = text.replace("choices: [baseline, ngram, mtp, eagle3, dflash]", "choices: [baseline, mtp]")
    assert stale != text
    spec.write_text(stale)
    assert role_docs.main(["--check", "--roles", str(tmp_path / "roles")]) == 1
    assert "method choices differ from spark_method_catalogue" in capsys.readouterr().err
    assert role_docs.main(["--roles", str(tmp_path / "roles")]) == 0
    assert spec.read_text() == text


def test_no_other_option_hard_codes_methods() -> None:
    """Any option whose choices name a method must offer exactly the catalogue's methods."""
    methods = set(catalogue_methods())
    for role in ROLES:
        for name, opt in spec_options(role).items():
            choices = set(opt.get("choices") or [])
            if choices & methods:
                assert choices == methods, f"roles/{role.name}: {name} choices {sorted(choices)} vs catalogue"


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_readme_documents_every_option(role: Path) -> None:
    readme = role / "README.md"
    assert readme.is_file(), f"roles/{role.name} has no README.md"
    text = readme.read_text()
    missing = [name for name in spec_options(role) if not re.search(rf"`{re.escape(name)}`", text)]
    assert not missing, f"roles/{role.name}/README.md does not mention (in backquotes) {missing}"


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_readme_names_its_facts_and_scenario(role: Path) -> None:
    text = (role / "README.md").read_text()
    assert re.search(r"(?im)^#+ .*\bfacts?\b", text), (
        f"roles/{role.name}/README.md: no section on the facts it writes"
    )
    assert re.search(r"molecule/[a-z_]+", text), f"roles/{role.name}/README.md names no molecule scenario"


def test_readme_variable_tables_are_generated_from_the_specs(capsys: pytest.CaptureFixture[str]) -> None:
    import role_docs

    assert role_docs.main(["--check"]) == 0, capsys.readouterr().err


def test_role_docs_check_names_a_stale_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    import role_docs

    role = tmp_path / "roles" / "serve"
    shutil.copytree(ROOT / "roles" / "serve", role)
    readme = role / "README.md"
    readme.write_text(readme.read_text().replace("| `serve_unit_template` |", "| `serve_unit_templat` |"))
    assert role_docs.main(["--check", "--roles", str(tmp_path / "roles")]) == 1
    assert "roles/serve/README.md: variable table differs" in capsys.readouterr().err
    assert role_docs.main(["--roles", str(tmp_path / "roles")]) == 0  # rewrites it
    assert "| `serve_unit_template` |" in readme.read_text()
    assert role_docs.main(["--check", "--roles", str(tmp_path / "roles")]) == 0


# --- the stage inputs (playbooks/vars/stages.yml knobs:) are generated by the same tool ---------------

def test_stage_knobs_are_generated_from_the_roles() -> None:
    import role_docs

    text = role_docs.STAGES.read_text(encoding="utf-8")
    assert role_docs.with_stage_knobs(text) == text, (
        "playbooks/vars/stages.yml: a stage's knobs differ from its roles' specs and files: "
        "run .venv/bin/python scripts/role_docs.py")


def _project_copy(tmp_path: Path) -> Path:
    import shutil

    for name in ("roles", "playbooks", "group_vars", "templates"):
        shutil.copytree(ROOT / name, tmp_path / name)
    return tmp_path


def test_a_new_default_becomes_an_input_of_its_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A default added to a role the stage runs whole, and a group_vars knob a template of it reads, are
    knobs of that stage after the generator runs, and --check names the stale file before it does."""
    import role_docs

    root = _project_copy(tmp_path)
    with (root / "roles/bench/defaults/main.yml").open("a") as f:
        f.write("# a knob added by the test\nbench_new_knob: 1\n")
    with (root / "group_vars/all/main.yml").open("a") as f:
        f.write("# read by a serve template only\nspark_new_shared: x\n")
    unit = root / "templates/sparkllm-vllm.service.j2"
    unit.write_text(unit.read_text() + "{# spark_new_comment #}{{ spark_new_shared | default('') }}\n")
    assert "bench_new_knob" not in role_docs.stage_knobs("serve", root)
    assert "bench_new_knob" in role_docs.stage_knobs("bench", root)
    assert "spark_new_shared" in role_docs.stage_knobs("serve", root)
    assert "spark_new_shared" not in role_docs.stage_knobs("preflight", root)
    roles = str(root / "roles")
    role_docs.main(["--check", "--roles", roles])
    assert "stages.yml: a stage's knobs differ" in capsys.readouterr().err
    role_docs.main(["--roles", roles])
    text = (root / "playbooks/vars/stages.yml").read_text()
    assert role_docs.with_stage_knobs(text, root) == text
    import yaml

    stages = yaml.safe_load(text)["spark_stages"]
    assert "bench_new_knob" in stages["bench"]["knobs"] and "spark_new_shared" in stages["serve"]["knobs"]
    assert "spark_new_shared" not in stages["bench"]["knobs"]


def test_stage_knobs_leave_out_what_is_no_input(tmp_path: Path) -> None:
    """A knob named only in a string literal or a Jinja comment, the force knobs and the facts of the stage,
    the names it sets itself (set_fact) and the gate's own knob are not inputs; the serving settings the
    settings filter picks from hostvars (spark_nnodes, a default of filter_plugins/spark_methods.py) are."""
    import role_docs

    root = _project_copy(tmp_path)
    serve = role_docs.stage_knobs("serve", root)
    assert {"spark_nnodes", "vllm_model_path", "vllm_port"} <= set(serve)
    assert not {"serve_drafter_update", "spark_vllm_images", "spark_stage_force"} & set(serve)
    assert "spark_vllm_images" not in role_docs.stage_knobs("build", root)  # the build sets it
    task = root / "roles/spark_ops/tasks/main.yml"
    task.write_text(task.read_text() + "\n- name: Test only\n  ansible.builtin.debug:\n"
                    "    msg: \"{{ 'see bench_seed' }}{# bench_warmup #}\"\n")
    assert not {"bench_seed", "bench_warmup"} & set(role_docs.stage_knobs("ops", root))
    task.write_text(task.read_text() + "    verbosity: \"{{ bench_seed }}\"\n")
    assert "bench_seed" in role_docs.stage_knobs("ops", root)


def test_stage_knobs_need_the_generated_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import role_docs

    root = _project_copy(tmp_path)
    stages = root / "playbooks/vars/stages.yml"
    stages.write_text(stages.read_text().replace(role_docs.KNOBS_MARK, "knobs by hand"))
    assert role_docs.main(["--check", "--roles", str(root / "roles")]) == 1
    assert "no header line" in capsys.readouterr().err
