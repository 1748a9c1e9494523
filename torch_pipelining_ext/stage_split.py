"""Split a model into pipeline stages by module names (public API).

:func:`pipeline_module_split` turns one model into this rank's
``PipelineStage`` objects; :func:`generate_module_names_per_stage` says which
modules go to which stage; :func:`build_stage_module` builds one stage model
alone.  The implementation, written as it would land upstream, is
``torch_pipelining_ext._stage_split``: while the ``stage_split`` patch is
applied, ``torch.distributed.pipelining.stage_split`` is that module.  This
module hands on its names and keeps the package's deprecated ones.

Writing a model that can be split
---------------------------------
A stage model is an instance of the model's own class that holds only its
stage's modules, under their original names; its ``forward`` is the model's
``forward``.  That forward therefore runs on every stage, with whatever the
stage lacks removed:

* a module the stage does not hold is ``None`` (``self.tok_embeddings`` on
  every stage but the first, ``self.norm`` and ``self.output`` on every stage
  but the last).  :func:`call_if_present` calls a module, or passes its input
  on unchanged when the module is ``None``;
* a container (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``)
  holds only the stage's entries, under their original keys: the stage of
  layers 4 and 5 has ``self.layers`` with the keys ``"4"`` and ``"5"``, so
  iterate (``for layer in self.layers``) instead of indexing; a stage
  without layers has an empty container;
* a stage's input is what the previous stage's forward returned (token ids
  on the first stage), its output is what the next stage receives (the
  loss function's input on the last stage).  Only tensors travel between
  stages.

:func:`generate_module_names_per_stage` expects, by default, the names of a
torchtitan-style model: ``tok_embeddings`` (first stage), a container
``layers``, then ``norm`` and ``output`` (last stage); its ``input_modules``,
``layers_prefix`` and ``output_modules`` arguments name other layouts (a
Hugging Face model: ``["model.embed_tokens"]``, ``"model.layers"``,
``["model.norm", "lm_head"]``).  Such a model::

    class MyModel(nn.Module):
        def __init__(self, ep_group):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block(dim, ep_group) for _ in range(4))
            self.norm = nn.RMSNorm(dim)
            self.output = nn.Linear(dim, vocab)

        def forward(self, x):
            x = call_if_present(self.tok_embeddings, x)  # ids -> hidden, stage 0 only
            for block in self.layers:  # this stage's blocks
                x = block(x)
            return call_if_present(self.output, call_if_present(self.norm, x))

Process groups, device meshes and other attributes that cannot be
deep-copied (``self.ep_group = group``) are shared by the stage modules, not
copied; one that can be neither copied nor shared, because it refers to the
model's tensors or modules, raises a ``TypeError`` naming it (``move=True``
takes the modules out of the model instead of copying anything).

How many stages: a loop schedule (``ScheduleInterleaved1F1B``, ...) runs
``num_stages / pp_size`` stages per pipeline rank, a single-stage one
(``Schedule1F1B``) one, and a V schedule (``ScheduleDualPipeV``,
``ScheduleZBVZeroBubble``) exactly two: ``2 * pp_size`` stages in all.
``examples/custom_moe.py`` in the repository is a complete, runnable model
of one's own (an MoE with expert parallelism) split and trained this way.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch.nn as nn

from torch_pipelining_ext._stage_split import *  # noqa: F403
from torch_pipelining_ext._stage_split import __all__ as _upstream_names


# every name of the upstream module, and the deprecated one
__all__ = [*_upstream_names, "split_module"]  # noqa: PLE0604


def split_module(
    model: nn.Module, module_names: Sequence[str], *, move: bool = False
) -> nn.Module:
    """Deprecated name of :func:`build_stage_module`.

    It clashed with ``torch.fx.passes.split_module``.
    """
    warnings.warn(
        "stage_split.split_module is deprecated and will be removed: use "
        "stage_split.build_stage_module (same arguments)",
        FutureWarning,
        stacklevel=2,
    )
    return build_stage_module(model, module_names, move=move)
