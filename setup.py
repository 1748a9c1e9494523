"""Packaging for torch_pipelining_ext (see README.md)."""

import re
from pathlib import Path

from setuptools import find_packages, setup


_ROOT = Path(__file__).parent
_VERSION = re.search(
    r'^__version__ = "([^"]+)"',
    (_ROOT / "torch_pipelining_ext" / "__init__.py").read_text(),
    re.MULTILINE,
).group(1)

setup(
    name="torch_pipelining_ext",
    version=_VERSION,
    description=(
        "Pipeline-parallel features for torch.distributed.pipelining: shared schedule "
        "state, real OVERLAP_F_B overlap with expert-parallel boundaries, an FSDP2 "
        "gradient fix and module-name stage splitting"
    ),
    long_description=(_ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    packages=find_packages(include=["torch_pipelining_ext", "torch_pipelining_ext.*"]),
    # the patch table and the planner's model presets are data
    package_data={
        "torch_pipelining_ext": ["_patching/patches.json", "sim/model_presets.json"]
    },
    install_requires=["torch>=2.9,<2.16"],
    extras_require={
        "test": [
            "pytest",
            # tools/run_tests.sh runs the suite on two workers
            "pytest-xdist",
            "expecttest",
            "hypothesis",
            "numpy",
            "matplotlib",
            # the trainer's --tensorboard test
            "tensorboard",
            "ruff==0.17.6",
            # tools/typecheck.sh; reads torch's inline types (torch 2.9-2.15)
            "mypy==2.4.1",
        ],
        "plot": ["matplotlib"],
        # python -m torch_pipelining_ext.train --tensorboard DIR
        "tensorboard": ["tensorboard"],
        # torch_pipelining_ext.hf; tested with transformers 4.57 (the last 4.x line) and 5.x
        "hf": ["transformers>=4.57,<6", "safetensors>=0.4"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "License :: OSI Approved :: BSD License",
    ],
)
