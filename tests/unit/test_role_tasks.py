"""Static checks over every role's task files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TASK_FILES = sorted(ROOT.glob("roles/*/tasks/*.yml"))
INCLUDES = ("ansible.builtin.include_tasks", "include_tasks", "ansible.builtin.import_tasks", "import_tasks")


def _tasks(node):
    """Every task of a task list, blocks included."""
    for task in node or []:
        if not isinstance(task, dict):
            continue
        yield task
        for key in ("block", "rescue", "always"):
            yield from _tasks(task.get(key))


def _included(task) -> str | None:
    for key in INCLUDES:
        if key in task:
            value = task[key]
            return value.get("file") if isinstance(value, dict) else value
    return None


def include_graph(files=tuple(TASK_FILES)) -> dict[Path, set[Path]]:
    graph = {}
    for path in files:
        targets = set()
        for task in _tasks(yaml.safe_load(path.read_text())):
            name = _included(task)
            if name and "{{" not in name:
                targets.add((path.parent / name).resolve())
        graph[path.resolve()] = targets
    return graph


_GRAPH = include_graph()


@pytest.mark.parametrize("path", TASK_FILES, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_no_task_file_includes_itself_directly_or_through_others(path, graph=None):
    """A task file reached again through its own includes recurses once per round; Ansible's include
    depth is bounded, so a long-running poll written that way dies (the old build follower did)."""
    graph = graph or _GRAPH
    start = path.resolve()
    seen, stack = set(), list(graph.get(start, ()))
    while stack:
        node = stack.pop()
        assert node != start, f"{path.name} includes itself (recursion)"
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))


def test_the_check_catches_recursion(tmp_path):
    tasks = tmp_path / "roles" / "r" / "tasks"
    tasks.mkdir(parents=True)
    (tasks / "a.yml").write_text("- ansible.builtin.include_tasks: b.yml\n")
    (tasks / "b.yml").write_text("- block:\n    - ansible.builtin.include_tasks:\n        file: a.yml\n")
    graph = include_graph(tuple(tasks.glob("*.yml")))
    with pytest.raises(AssertionError, match="includes itself"):
        test_no_task_file_includes_itself_directly_or_through_others(tasks / "a.yml", graph)
