"""``@task.vllm_batch``: a TaskFlow function that returns the requests, run as a :class:`~airflow_vllm_batch.operators.vllm_batch.VLLMBatchOperator`.

Like ``@task.bash`` (the function returns the command) and ``@task.sql`` (the query): the
decorated function runs on the worker when the task starts and returns what the operator's
``requests=`` takes (prompts, chat message lists or request bodies); the decorator's
arguments are the operator's; the task's return value (XCom) is the run's manifest.

.. code-block:: python

    @task.vllm_batch(output_uri="s3://my-bucket/answers/{{ ds }}.jsonl", model="Qwen/Qwen3-0.6B")
    def classify(reviews: list[str]) -> list[str]:
        return [f"Positive or negative? {review}" for review in reviews]
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
from airflow.sdk.definitions._internal.types import SET_DURING_EXECUTION

from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.version_compat import AirflowFailException, determine_kwargs

if TYPE_CHECKING:
    from airflow.sdk import Context


class _VLLMBatchDecoratedOperator(DecoratedOperator, VLLMBatchOperator):
    """Call the function for the requests, then run them as :class:`VLLMBatchOperator` does.

    :param python_callable: the decorated function; it returns the requests.
    :param op_args: positional arguments of the function (templated).
    :param op_kwargs: keyword arguments of the function (templated).
    """

    template_fields: Sequence[str] = (*DecoratedOperator.template_fields, *VLLMBatchOperator.template_fields)
    template_fields_renderers: ClassVar[dict[str, str]] = {
        **DecoratedOperator.template_fields_renderers,
        **VLLMBatchOperator.template_fields_renderers,
    }
    custom_operator_name: str = "@task.vllm_batch"
    # The rendered fields shown in the UI then hold the requests the function returned.
    overwrite_rtif_after_execution: bool = True

    def __init__(
        self,
        *,
        python_callable: Callable,
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("requests") is not None or kwargs.get("input_uri") is not None:
            raise ConfigurationError(
                "@task.vllm_batch takes its requests from the function's return value: drop requests= and "
                "input_uri= from the decorator (a file in S3 goes to VLLMBatchOperator(input_uri=...) instead)."
            )
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            requests=SET_DURING_EXECUTION,
            **kwargs,
        )

    @property
    def xcom_push(self) -> bool:
        """``do_xcom_push``: Airflow 3.0's ``DecoratedOperator.execute`` reads ``self.xcom_push`` (as common-sql's ``@task.sql`` provides it)."""
        return self.do_xcom_push

    @xcom_push.setter
    def xcom_push(self, value: bool) -> None:
        self.do_xcom_push = value

    def execute(self, context: Context) -> Any:
        # The function's values are data, not templates: they are not rendered (a prompt may hold "{{").
        kwargs = determine_kwargs(self.python_callable, self.op_args, {**context, **self.op_kwargs})
        try:
            self.requests = _checked_requests(
                self.python_callable(*self.op_args, **kwargs), self.python_callable
            )
        except ConfigurationError as err:
            raise AirflowFailException(str(err)) from err
        return super().execute(context)


def _checked_requests(value: Any, function: Callable) -> list[Any]:
    """The function's return value as a list of requests, or an error naming the function and what it returned."""
    name = getattr(function, "__name__", repr(function))
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConfigurationError(
            f"@task.vllm_batch function {name!r} must return the requests: a list of prompts, chat message lists "
            f"or request bodies, got {type(value).__name__} {str(value)[:80]!r}."
        )
    if not value:
        raise ConfigurationError(
            f"@task.vllm_batch function {name!r} returned no requests: there is nothing to run."
        )
    return list(value)


def vllm_batch_task(python_callable: Callable | None = None, **kwargs: Any) -> TaskDecorator:
    """Wrap a function that returns the requests into a vLLM batch task (``@task.vllm_batch``).

    The keyword arguments are :class:`~airflow_vllm_batch.operators.vllm_batch.VLLMBatchOperator`'s
    (``output_uri``, ``model``, ``engine=VLLMServer(...)``...), except ``requests`` and
    ``input_uri``: the function's return value is the requests. The task returns the manifest.

    :param python_callable: the function to decorate.
    """
    # The manifest is one XCom; the function's return annotation (the requests) says nothing of it.
    kwargs.setdefault("multiple_outputs", False)
    return task_decorator_factory(
        python_callable=python_callable, decorated_operator_class=_VLLMBatchDecoratedOperator, **kwargs
    )
