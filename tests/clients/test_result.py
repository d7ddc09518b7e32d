"""What a user does with a :class:`Result`: plain values and JSON with class names, and the
detections drawn on the frame."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dlad.protocol import Timing
from dlad_client import Result
from dlad_client._draw import PALETTE

ROWS = np.array([[10, 20, 50, 60, 0.9, 1], [30.5, 5, 90, 40, 0.4, 7]], np.float32)


def _result(rows: np.ndarray = ROWS, names: tuple[str, ...] = ("person", "car")) -> Result:
    timing = Timing(queue_us=5, pre_us=10, device_us=900, post_us=30, total_us=960,
                    start_ns=1_000, end_ns=901_000)  # fmt: skip
    return Result(7, rows, "dla1", timing, names)


def test_a_result_is_plain_values_and_one_line_of_json() -> None:
    out = _result().to_dict()
    assert out == {
        "request_id": 7,
        "device": "dla1",
        "timing": {
            "queue_us": 5,
            "pre_us": 10,
            "device_us": 900,
            "post_us": 30,
            "total_us": 960,
            "start_ns": 1_000,
            "end_ns": 901_000,
        },
        "detections": [
            {
                "box": [10.0, 20.0, 50.0, 60.0],
                "score": pytest.approx(0.9),
                "class_id": 1,
                "class_name": "car",
            },
            {
                "box": [30.5, 5.0, 90.0, 40.0],
                "score": pytest.approx(0.4),
                "class_id": 7,
                "class_name": "7",
            },
        ],
    }
    text = _result().to_json()
    assert "\n" not in text
    assert json.loads(text)["detections"][0]["class_name"] == "car"
    assert _result(np.empty((0, 6), np.float32)).to_dict()["detections"] == []


def test_boxes_are_drawn_in_their_class_colour_on_a_copy() -> None:
    image = np.zeros((100, 120, 3), np.uint8)
    drawn = _result().draw(image)
    assert not image.any()  # the frame itself is untouched
    assert drawn.shape == image.shape
    assert tuple(drawn[60, 30]) == PALETTE[1]  # the first box's bottom edge
    assert tuple(drawn[40, 89]) == PALETTE[7]  # the second box's right edge
    assert (drawn[75:, :] == 0).all()  # nothing below the boxes
    bgr = _result().draw(image, bgr=True)
    assert tuple(bgr[60, 30]) == PALETTE[1][::-1]
    gray = _result().draw(np.zeros((100, 120), np.uint8))
    assert gray.shape == (100, 120, 3)


@pytest.mark.parametrize("shape", [(10, 10, 2), (10,), (10, 10, 4)])
def test_drawing_on_another_shape_is_a_value_error(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="image must be"):
        _result().draw(np.zeros(shape, np.uint8))
