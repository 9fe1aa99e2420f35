"""Ready-made optimizers, each a named chain of public transforms.

* :mod:`muonfx.presets.standard`: :func:`muon`, :func:`adamw` and :func:`muon_adamw`, as
  ``torch.optim.Muon`` and ``torch.optim.AdamW`` compute them, and the default split
  between them (:func:`default_muon_labels`);
* :mod:`muonfx.presets.options`: :class:`MuonOptions`, Muon's options defined once, and
  :func:`takes_muon_options`, which gives them to every builder that runs Muon;
* :mod:`muonfx.presets.variants`: published variants (Moonlight, NorMuon, cautious weight
  decay, momentum warm-up, per-head Newton-Schulz, optax's and modded-nanogpt's Muon);
* :mod:`muonfx.presets.predecessor`: :func:`fsdp_muon`, the predecessor ``muon_fsdp``'s chain.

Presets import transforms, combinators and wrappers, never the adapter (:mod:`muonfx.optim`).
"""

from .options import MeaningChangedWarning, MuonOptions, insert_step, muon_options_of, takes_muon_options
from .predecessor import fsdp_muon
from .standard import ADAMW_KEY_PATTERN, adamw, default_muon_labels, muon, muon_adamw
from .variants import (modded_nanogpt_normuon, moonlight, muon_cautious, muon_per_head, muon_with_momentum_warmup,
                       normuon, optax_muon, split_newton_schulz)

__all__ = ["muon", "adamw", "muon_adamw", "default_muon_labels", "ADAMW_KEY_PATTERN", "MuonOptions",
           "takes_muon_options", "muon_options_of", "insert_step", "MeaningChangedWarning", "moonlight", "normuon",
           "muon_cautious", "muon_with_momentum_warmup", "split_newton_schulz", "muon_per_head", "optax_muon",
           "modded_nanogpt_normuon", "fsdp_muon"]
