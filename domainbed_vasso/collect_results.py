"""``python -m domainbed_vasso.collect_results``: DomainBed's own
``domainbed.scripts.collect_results``, unmodified and with exactly its flags, after
:func:`domainbed_vasso.register`, so that its tables know this package's names too.

    python -m domainbed_vasso.collect_results --input_dir sweep_digits/

Stock collect_results prints only the datasets listed in ``domainbed.datasets.DATASETS``;
``RotatedDigits`` is not in that list for training and sweeps (a sweep without
``--datasets`` stays DomainBed's default), so this entry point adds it here, in its own
process. A stock collect_results in a process that never called ``register()`` drops
the RotatedDigits records and has no table left to print.
"""

import sys

from . import _cli


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    _cli.register_or_exit()
    from domainbed import datasets

    from . import digits_dataset
    digits_dataset.list_in_datasets(datasets)
    _cli.run_domainbed_script("domainbed.scripts.collect_results", "domainbed_vasso.collect_results", argv)


if __name__ == "__main__":
    main()
