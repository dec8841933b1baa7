"""Warnings that stock fairseq 0.12 causes in its dependencies on every run.

fairseq's own calls into Hydra (its deprecated ``hydra.experimental`` API, ``# @package
_group_`` headers, schema matching, ``strict``) and into torch (``torch.cuda.amp.autocast``,
a float attention mask beside a bool padding mask, ``pin_memory`` without an accelerator)
print about 15 lines of deprecation warnings at the start of every fairseq-train, and
hundreds in a test session. None is about this plugin and none can be acted on by its
users, so importing the user-dir silences exactly these (category and the start of the
message); every other warning, ours included, prints as before. ``torch.jit.script``'s
FutureWarning comes while fairseq itself is imported: fairseq-train prints it before it
loads any user-dir, while the processes that import this package first (the demo,
vasso-bleu) do not print it.

The tests' process gets the same list from ``setup.cfg`` (``[tool:pytest]
filterwarnings``, one ``ignore:MESSAGE:CATEGORY`` line each; a test keeps the two equal).
"""

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
    (UserWarning, r"Support for mismatched key_padding_mask and attn_mask is deprecated"),
    (UserWarning, r"'pin_memory' argument is set as true but no accelerator is found"),
)


def silence_foreign_warnings():
    """Ignore the warnings of :data:`FOREIGN` in this process (idempotent)."""
    for category, message in FOREIGN:
        warnings.filterwarnings("ignore", message=message, category=category)
