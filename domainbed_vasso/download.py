"""``python -m domainbed_vasso.download --data_dir ./data PACS``: DomainBed's own download
functions (``domainbed/scripts/download.py``) for the named image datasets.

DomainBed's download script has no flag for the dataset: at b93c22a its command line
fetches TerraIncognita only, the other datasets' calls being commented out. This runs
DomainBed's function for each dataset named, into ``--data_dir``, where DomainBed's
train script then finds it. The Google Drive downloads need ``gdown``
(``.venv/bin/pip install gdown``).
"""

import argparse
import os
import sys

from . import _locate

#: dataset -> (DomainBed's download function, the folder under --data_dir its train script reads)
DOWNLOADS = {
    "PACS": ("download_pacs", "PACS"),
    "VLCS": ("download_vlcs", "VLCS"),
    "OfficeHome": ("download_office_home", "office_home"),
    "TerraIncognita": ("download_terra_incognita", "terra_incognita"),
    "DomainNet": ("download_domain_net", "domain_net"),
}

#: what is known of a download's size (DomainBed's script does not say)
SIZES = {"PACS": "9,991 images, about 200 MB"}


def download_command(dataset, data_dir):
    return f".venv/bin/python -m domainbed_vasso.download --data_dir {data_dir} {dataset}"


def missing_dataset(dataset, data_dir):
    """One line naming the fix when ``dataset`` needs a download that ``data_dir`` lacks; else None."""
    if dataset not in DOWNLOADS or not data_dir:
        return None
    folder = os.path.join(data_dir, DOWNLOADS[dataset][1])
    if os.path.isdir(folder):
        return None
    size = f" ({SIZES[dataset]})" if dataset in SIZES else ""
    return (f"--dataset {dataset} reads {folder}, which does not exist: download it first{size}: "
            f"{download_command(dataset, data_dir)} (needs gdown: .venv/bin/pip install gdown)")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="domainbed_vasso.download", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True, help="where DomainBed's train script reads datasets")
    parser.add_argument("datasets", nargs="+", choices=sorted(DOWNLOADS))
    args = parser.parse_args(argv)
    _locate.exit_if_requirement_missing("domainbed_vasso.download")
    from . import _cli
    _cli.register_or_exit()
    try:
        import gdown  # noqa: F401  (DomainBed's script imports it)
    except ImportError:
        _cli.fail("DomainBed's download script needs gdown: .venv/bin/pip install gdown")
    from domainbed.scripts import download
    os.makedirs(args.data_dir, exist_ok=True)
    for dataset in args.datasets:
        function, folder = DOWNLOADS[dataset]
        print(f"domainbed_vasso.download: {dataset} -> {os.path.join(args.data_dir, folder)} "
              f"(DomainBed's {function})", file=sys.stderr)
        getattr(download, function)(args.data_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
