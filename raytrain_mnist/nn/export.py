"""The ConvNet taken away from this package: a ``torch.export`` program or an ONNX model.

Both take what the model takes in training: float32 images ``(N, 1, 28, 28)``, prepared as
:data:`PREPARATION` says (MNIST-like uint8 digits, white on black, scaled to 0-1 and
normalised by MNIST's mean and standard deviation, :func:`raytrain_mnist.nn.model.normalize`),
with any batch size N; both return the logits ``(N, 10)``. Plain torch: no Ray.
"""

from __future__ import annotations

import copy
import os

import torch

from raytrain_mnist.nn.model import MNIST_MEAN, MNIST_STD, ConvNet

#: The ONNX opset the model is written in (onnxruntime >= 1.16 runs it).
ONNX_OPSET = 18
FORMATS = ("pt2", "onnx")
#: The largest batch the exported programs are traced for (any N from 1 up to it).
MAX_BATCH = 1 << 16
#: How an input is prepared, written beside every exported model.
PREPARATION = {
    "input": {"name": "images", "dtype": "float32", "shape": ["N", 1, 28, 28]},
    "output": {"name": "logits", "dtype": "float32", "shape": ["N", 10]},
    "pixels": "28x28 uint8, white digit on black (0 = background), as MNIST's images; "
    "the digit scaled into a 20x20 box and centred by its centre of mass",
    "scale": 1 / 255,
    "mean": MNIST_MEAN,
    "std": MNIST_STD,
    "formula": f"images = (pixels / 255 - {MNIST_MEAN}) / {MNIST_STD}",
    "prediction": "argmax of the logits; softmax of them for probabilities",
}


def _example() -> tuple[torch.Tensor]:
    return (torch.zeros(2, 1, 28, 28),)


def _dynamic_batch() -> dict:
    return {"x": {0: torch.export.Dim("batch", min=1, max=MAX_BATCH)}}


def _plain(model: ConvNet) -> ConvNet:
    """A copy of ``model`` in eval mode with contiguous weights: the channels-last kernels
    that train faster are strided views that the saved archive would store as partial
    tensors (``torch.export.save`` warns so); the values are the same."""
    return copy.deepcopy(model).eval().to(memory_format=torch.contiguous_format)


def export_program(model: ConvNet) -> torch.export.ExportedProgram:
    """``model`` (in eval mode) as a ``torch.export`` program with a dynamic batch."""
    model = _plain(model)
    with torch.no_grad():
        return torch.export.export(model, _example(), dynamic_shapes=_dynamic_batch())


def save_program(model: ConvNet, path: str | os.PathLike) -> None:
    """The program, written with ``torch.export.save`` (``torch.export.load`` reads it)."""
    torch.export.save(export_program(model), str(path))


def save_onnx(model: ConvNet, path: str | os.PathLike) -> None:
    """``model`` as an ONNX model (opset :data:`ONNX_OPSET`, dynamic batch), through torch's
    dynamo exporter (it needs the ``onnxscript`` package)."""
    model = _plain(model)
    with torch.no_grad():
        program = torch.onnx.export(
            model,
            _example(),
            dynamo=True,
            opset_version=ONNX_OPSET,
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=_dynamic_batch(),
            verbose=False,
        )
    program.save(str(path))
