"""The opt-in ``cloudpickle`` serializer, as kombu sees it through the entry point."""
from __future__ import annotations

from typing import Callable

import pytest
from kombu import serialization
from kombu.exceptions import ContentDisallowed

from celery_zk.serializers import CONTENT_TYPE


def make_adder(n: int) -> Callable[[int], int]:
    def add(x: int) -> int:  # a closure over n: plain pickle cannot send it
        return x + n
    return add


def roundtrip(obj: object) -> object:
    content_type, encoding, body = serialization.dumps(obj, serializer="cloudpickle")
    assert (content_type, encoding) == (CONTENT_TYPE, "binary")
    return serialization.loads(body, content_type, encoding,
                               accept={CONTENT_TYPE, "application/json"})


def test_registered_by_the_entry_point() -> None:
    # kombu loads kombu.serializers entry points at import: nobody imported ours.
    assert serialization.registry.type_to_name[CONTENT_TYPE] == "cloudpickle"
    assert serialization.prepare_accept_content(["cloudpickle"]) == {CONTENT_TYPE}


def test_lambda_and_closure_roundtrip() -> None:
    square = roundtrip(lambda x: x * x)
    assert callable(square) and square(7) == 49
    add_five = roundtrip(make_adder(5))
    assert add_five(1) == 6


def test_task_style_payload_roundtrip() -> None:
    args = ((make_adder(2), 40), {"fn": lambda: "kw"}, {"callbacks": None})
    (fn, value), kwargs, embed = roundtrip(args)
    assert fn(value) == 42 and kwargs["fn"]() == "kw" and embed == {"callbacks": None}


def test_text_body_is_accepted() -> None:
    # Some body encodings hand the decoder text; latin-1 maps it back byte for byte.
    _, _, body = serialization.dumps(make_adder(1), serializer="cloudpickle")
    fn = serialization.loads(body.decode("latin-1"), CONTENT_TYPE, "binary",
                             accept={CONTENT_TYPE})
    assert fn(1) == 2


def test_opt_in_only() -> None:
    """Registered is not accepted: Celery's default accept_content is json only."""
    _, _, body = serialization.dumps(lambda: 1, serializer="cloudpickle")
    with pytest.raises(ContentDisallowed):
        serialization.loads(body, CONTENT_TYPE, "binary",
                            accept=serialization.prepare_accept_content(["json"]))


def test_celery_default_accept_content_excludes_it() -> None:
    from celery import Celery

    app = Celery("t", set_as_current=False)
    try:
        assert "cloudpickle" not in app.conf.accept_content
        assert CONTENT_TYPE not in serialization.prepare_accept_content(
            app.conf.accept_content)
    finally:
        app.close()
