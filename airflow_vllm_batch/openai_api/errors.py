"""The error the OpenAI API answers in OpenAI's shape: its routes and its caller check raise it, the app's handler answers it."""

from __future__ import annotations

from fastapi import HTTPException


class OpenAIError(HTTPException):
    """An error answered in OpenAI's shape.

    :param status_code: the HTTP status.
    :param message: what went wrong and what to do.
    :param param: the request parameter at fault, if one is.
    """

    def __init__(
        self, status_code: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(status_code=status_code, detail=message)
        self.param, self.code = param, code
