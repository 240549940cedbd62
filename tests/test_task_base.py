"""`Task` is an abstract base class: every task the registry can hand out instantiates, and a task that leaves out
a method every task must define cannot be made (not a NotImplementedError half way through a build)."""

from __future__ import annotations

import inspect

import pytest

from exporter import tasks
from exporter.tasks.base import Task


def _every_task_class() -> set[type[Task]]:
    found, todo = set(), [Task]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("exporter.tasks") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


REQUIRED = {
    *("input_size_of", "num_classes_in", "construct", "preprocessing", "transform", "load_data", "output"),
    *("fidelity", "labeled", "vs_eager", "golden"),
}


def test_task_declares_what_each_task_must_define():
    assert inspect.isabstract(Task)
    assert Task.__abstractmethods__ == REQUIRED
    with pytest.raises(TypeError, match="abstract"):
        Task(2, (8, 8))


@pytest.mark.parametrize("cls", sorted(_every_task_class(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_task_class_instantiates(cls):
    assert not inspect.isabstract(cls)
    task = cls(3, (32, 32))
    assert (task.num_classes, task.input_size, task.output()["name"]) == (3, (32, 32), cls.output_name)


def test_the_registry_and_its_groups_hand_out_only_tasks_that_instantiate():
    registered = {*tasks.TASKS.values(), *tasks.GROUPS.values()}
    assert registered <= _every_task_class()
    assert {tasks.DetectionsInGraph, tasks.RegionDetection} <= _every_task_class()
    for cls in registered:
        assert cls(2, (16, 16)).describe()["name"] == cls.name


def test_a_task_that_leaves_out_a_required_method_cannot_be_made():
    body = {name: getattr(tasks.Classification, name) for name in REQUIRED - {"golden"}}
    body["name"] = "incomplete"

    without_golden = type("WithoutGolden", (Task,), body)
    with pytest.raises(TypeError, match="golden"):
        without_golden(2, (8, 8))

    complete = type("Complete", (without_golden,), {"golden": tasks.Classification.golden})
    assert complete(2, (8, 8)).output()["shape"] == [1, 2]
