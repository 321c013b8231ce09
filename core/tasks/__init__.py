"""Built-in tasks (digits, diabetes, shapes, cifar10, imagefolder, synthetic), the Task interface, and ``@task``,
which declares a user's task so that a spec's ``task.target`` may name it."""
from core.tasks.base import Task, TaskError, builtin_task_names, make_task, register, task

__all__ = ["Task", "TaskError", "builtin_task_names", "make_task", "register", "task"]
