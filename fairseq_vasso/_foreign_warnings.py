"""Warnings that stock fairseq 0.12 causes in its dependencies on every run.

fairseq's own calls into Hydra (its deprecated ``hydra.experimental`` API, ``# @package
_group_`` headers, schema matching, ``strict``) and into torch (``torch.cuda.amp.autocast``,
a float attention mask beside a bool padding mask, ``pin_memory`` without an accelerator)
print about 15 lines of deprecation warnings at the start of every fairseq-train, and
hundreds in a test session. None is about this plugin and none can be acted on by its
users, so importing the user-dir silences exactly these (category and the start of the
message); every other warning, ours included, prints as before.

Three FutureWarnings come while fairseq itself is imported (:data:`AT_FAIRSEQ_IMPORT`:
``torch.jit.script``, and fairscale's ``torch.cuda.amp.custom_fwd`` / ``custom_bwd``,
imported by fairseq's sharding): a ``fairseq-train`` or ``fairseq-preprocess`` started
from a shell prints them before it could load any user-dir.  Where this package is
imported first (the demo, vasso-bleu, the recipe's tools) they are filtered in the
process, and importing it also adds them to ``PYTHONWARNINGS``, so that every Python
process started from here on (fairseq-train's spawned ranks, vasso-bleu's
fairseq-generate) filters them from its start.

The tests' process gets the same list from ``setup.cfg`` (``[tool:pytest]
filterwarnings``, one ``ignore:MESSAGE:CATEGORY`` line each; a test keeps the two equal).
"""

import os
import warnings

#: (category, regular expression matched against the start of the message)
FOREIGN = (
    (FutureWarning, r"`torch\.jit\.script` is deprecated"),
    (UserWarning, r"hydra\.experimental\.initialize\(\) is no longer experimental"),
    (UserWarning, r"hydra\.experimental\.compose\(\) is no longer experimental"),
    (UserWarning, r"\s*The version_base parameter is not specified"),
    (UserWarning, r"In '[^']*'. Usage of deprecated keyword in package header"),
    (UserWarning, r"\s*'[^']*' is validated against ConfigStore schema with the same name"),
    (UserWarning, r"\s*The strict flag in the compose API is deprecated"),
    (FutureWarning, r"`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated"),
    (FutureWarning, r"`torch\.cuda\.amp\.custom_(fwd|bwd)\(args\.\.\.\)` is deprecated"),
    (UserWarning, r"Support for mismatched key_padding_mask and attn_mask is deprecated"),
    (UserWarning, r"'pin_memory' argument is set as true but no accelerator is found"),
)


#: those of FOREIGN that fairseq's own import prints: the start of each message, literally
#: (``PYTHONWARNINGS`` takes no regular expressions; none holds a ``:`` or a ``,``)
AT_FAIRSEQ_IMPORT = ("`torch.jit.script` is deprecated", "`torch.cuda.amp.custom_fwd(args...)` is deprecated",
                     "`torch.cuda.amp.custom_bwd(args...)` is deprecated")


def pythonwarnings(value=None):
    """``value`` (a ``PYTHONWARNINGS``, default none) with :data:`AT_FAIRSEQ_IMPORT` ignored
    after it (idempotent; what the user set stays, and comes first)."""
    rules = [rule for rule in (value or "").split(",") if rule]
    rules += [rule for rule in (f"ignore:{m}:FutureWarning" for m in AT_FAIRSEQ_IMPORT) if rule not in rules]
    return ",".join(rules)


def silence_foreign_warnings():
    """Ignore the warnings of :data:`FOREIGN` in this process, and those of
    :data:`AT_FAIRSEQ_IMPORT` in the Python processes it starts (idempotent)."""
    for category, message in FOREIGN:
        warnings.filterwarnings("ignore", message=message, category=category)
    os.environ["PYTHONWARNINGS"] = pythonwarnings(os.environ.get("PYTHONWARNINGS"))
