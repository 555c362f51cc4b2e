"""Failure bundles: everything needed to rebuild one training step, in a directory.

Layout (every file but the manifest is written with ``torch.save`` and read back with
``torch.load(weights_only=True)``, so loading never runs arbitrary pickled code)::

    BUNDLE/
      manifest.json   strict JSON a person can read: step, incident, state markers, autocast,
                      input dtypes, model precision, environment, the SHA-256 of every file, and
                      ``digest``: the SHA-256 of the manifest itself (see :func:`manifest_digest`)
      batch.pt        {"args": [...], "kwargs": {...}, "single": bool[, "mapping": True]}: the
                      tensors that entered the step, cloned *before* the forward (later in-place
                      edits do not reach the bundle); what is kept of other batches: below
      rng.pt          RNG states captured before the step: python, numpy, torch CPU, every CUDA device
      model.pt        model.state_dict()
      optimizer.pt    optimizer.state_dict()        (when an optimizer was given)
      scaler.pt       GradScaler.state_dict()       (when a scaler was given)

Writes are atomic: everything goes to a temporary sibling directory that is renamed into place,
and an existing path is never overwritten (the monitor writes a rerun's bundle under the first
free ``-1``, ``-2``, ... suffix instead). A write that fails (a full disk) removes the partial
bundle, closes every file it opened and says how many bytes were free. A writer that was killed
(SIGKILL, the out-of-memory killer, a preempted node) cannot remove its temporary directory: see
Note [stale temporary directories] for who removes it.

``load_bundle`` verifies before it trusts anything:

- the manifest: UTF-8, strict JSON (no NaN / Infinity), at most 16 MiB and 32 levels deep, every
  field of the type ``write_bundle`` writes, and its ``digest`` must match its content -- a
  flipped byte (the step, the incident's name) is refused as "edited or corrupted". The digest
  is a checksum, not a signature: it catches corruption and hand edits, not someone who
  recomputes it (nothing in a bundle is secret or signed).
- every file: a regular file inside the bundle directory (a symbolic link is refused, even one
  pointing inside), matching the manifest's hash, so a truncated or edited file is refused with
  its name; a file whose hash was forged too still cannot execute code (``weights_only=True``)
  and must hold what ``write_bundle`` writes (e.g. ``model.pt`` a dict of str -> Tensor).

Batches. ``batch.pt`` holds only what ``weights_only`` loading accepts -- tensors, numbers,
strings, None and lists / dicts of them -- so other batch objects are stored as follows
(:func:`clone_batch`, :func:`clone_forward_inputs`); ``path`` names an element the way
``manifest["inputs"]`` does (``args[0]``, ``args[0].mask``, ``kwargs.input_ids``):

- a mapping that is not a plain dict (an HF ``BatchEncoding``, which is a ``UserDict``; a
  ``ModelOutput``, an ``OrderedDict``): a dict of its items. ``model(**batch)`` is stored as keyword
  arguments (``"mapping": True``) and replays as ``model(**dict)``; ``model(batch)`` is stored as
  one positional input (``"single": True``) and replays as ``model(dict)`` -- a model that reads
  ``batch["input_ids"]`` gets what it read, one that uses ``batch.input_ids`` (attribute access of
  a ``BatchEncoding``) needs ``replay(..., forward=...)``. Tuples (named ones too) become lists.
- a dataclass instance: a dict of its fields. Rebuilding the user's class would take unpickling
  (importing and running its code), which ``load_bundle`` never does, so replay passes the fields
  as a dict; to replay a model that needs the class itself, rebuild it in ``forward=``, e.g.
  ``replay(bundle, model, forward=lambda m, b: m(Batch(**b)))``. Capturing one warns once per
  monitor, saying so.
- ``manifest["batch_types"]``: ``path -> qualified type name`` of every element converted so
  (a mapping, a dataclass, a tuple or number subclass; the first 256).
- anything else (a custom object, a generator, a numpy array, an object that refers to itself):
  the monitor stores None in its place, warns once per monitor naming its type, and lists it in
  ``manifest["batch_dropped"]`` (``[{"path": ..., "type": ...}]``, the first 256, with
  ``batch_dropped_total`` when there were more); every tensor around it is kept. A monitor
  feature never stops the run, so the watched forward never raises for a batch it cannot store;
  ``capture_bundle`` and ``mon.step(batch)``, called by the user with the batch, raise
  ``TypeError`` instead. These manifest fields are optional: a bundle written before them loads.

Versions: format 2 added the manifest digest. A format-1 bundle (written before it) still loads
-- its files are verified as before -- but its manifest cannot be, so ``load_bundle`` warns and
sets ``Bundle.manifest_verified = False``; a format-1 manifest that carries a digest is refused
(its version was edited).
"""
from __future__ import annotations

from nanscan.capture.batch import (  # noqa: F401
                                           _MAX_NOTED,
                                           batch_notices,
                                           clone_batch,
                                           clone_forward_inputs,
)
from nanscan.capture.bundle_format import (  # noqa: F401
                                           FORMAT,
                                           READABLE_VERSIONS,
                                           VERSION,
                                           BundleError,
                                           manifest_digest,
)
from nanscan.capture.conditions import (  # noqa: F401
                                           autocast_state,
                                           capture_rng,
                                           environment,
                                           model_precision,
                                           restore_rng,
)
from nanscan.capture.load import Bundle, load_bundle  # noqa: F401
from nanscan.capture.write import (  # noqa: F401
                                           BundleWriteError,
                                           capture_bundle,
                                           clean_stale_temp_dirs,
                                           free_bundle_path,
                                           write_bundle,
)
