"""Built-in tasks (digits, cifar10, imagefolder, synthetic) and the Task interface."""
from core.tasks.base import Task, TaskError, builtin_task_names, make_task, register

__all__ = ["Task", "TaskError", "builtin_task_names", "make_task", "register"]
