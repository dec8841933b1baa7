"""``python -m domainbed_vasso.download --data_dir ./data PACS``: DomainBed's own download
functions (``domainbed/scripts/download.py``) for the named image datasets.

DomainBed's download script has no flag for the dataset: at b93c22a its command line
fetches TerraIncognita only, the other datasets' calls being commented out. This runs
DomainBed's function for each dataset named, into ``--data_dir``, where DomainBed's
train script then finds it. The Google Drive downloads need ``gdown``
(``.venv/bin/pip install gdown``).

Each dataset is downloaded into a temporary folder beside its own (``--data_dir``/
``.download-NAME-*``) and moved into place only once DomainBed's function returned and the
folder holds what DomainBed's dataset class reads (a folder per domain, a folder per class
in each, images in them); a failed or interrupted download leaves nothing behind. A
dataset already complete is not downloaded again.
"""

import argparse
import os
import shutil
import sys
import tempfile

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

#: the domains of each dataset: DomainBed's MultipleEnvironmentImageFolder reads one
#: sub-folder per domain (its class's ENVIRONMENTS), each an ImageFolder (a folder per class)
DOMAINS = {"PACS": 4, "VLCS": 4, "OfficeHome": 4, "TerraIncognita": 4, "DomainNet": 6}


def incomplete(dataset, folder):
    """What ``folder`` lacks of a downloaded ``dataset`` (one phrase), or None when it holds
    DOMAINS[dataset] domain folders, each with class folders that hold files."""
    try:
        domains = sorted(e.path for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
    except FileNotFoundError:
        return "does not exist"
    except NotADirectoryError:
        return "is not a folder"
    if len(domains) < DOMAINS[dataset]:
        return f"holds {len(domains)} of its {DOMAINS[dataset]} domain folders"
    for domain in domains:
        classes = [e.path for e in os.scandir(domain) if e.is_dir()]
        if not classes:
            return f"has no class folders in {os.path.basename(domain)}"
        if not any(any(f.is_file() for f in os.scandir(c)) for c in classes):
            return f"has no images in {os.path.basename(domain)}"
    return None


def download_command(dataset, data_dir):
    return f".venv/bin/python -m domainbed_vasso.download --data_dir {data_dir} {dataset}"


def missing_dataset(dataset, data_dir):
    """One line naming the fix when ``dataset`` needs a download that ``data_dir`` lacks; else None."""
    if dataset not in DOWNLOADS or not data_dir:
        return None
    folder = os.path.join(data_dir, DOWNLOADS[dataset][1])
    lacks = incomplete(dataset, folder)
    if lacks is None:
        return None
    size = f" ({SIZES[dataset]})" if dataset in SIZES else ""
    first = ("download it first" if lacks == "does not exist" else
             "an interrupted download? remove it and download it again")
    return (f"--dataset {dataset} reads {folder}, which {lacks}: {first}{size}: "
            f"{download_command(dataset, data_dir)} (needs gdown: .venv/bin/pip install gdown)")


def fetch(dataset, data_dir, function):
    """Runs DomainBed's download ``function(dir)`` for ``dataset`` in a temporary folder beside
    its own, then moves the dataset's folder into ``data_dir`` when it is complete. Returns
    the folder; raises SystemExit naming what is wrong otherwise (nothing left behind)."""
    folder = os.path.join(data_dir, DOWNLOADS[dataset][1])
    if incomplete(dataset, folder) is None:
        print(f"domainbed_vasso.download: {dataset}: {folder} is complete already, not downloaded again",
              file=sys.stderr)
        return folder
    if os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)  # what an older, failed download left behind
    elif os.path.exists(folder):
        raise SystemExit(f"domainbed_vasso.download: error: {folder} exists but {incomplete(dataset, folder)}: "
                         f"remove it (an interrupted download?) and run this again")
    staging = tempfile.mkdtemp(prefix=f".download-{dataset}-", dir=data_dir)
    try:
        function(staging)
        lacks = incomplete(dataset, os.path.join(staging, DOWNLOADS[dataset][1]))
        if lacks is not None:
            raise SystemExit(f"domainbed_vasso.download: error: DomainBed's download of {dataset} finished, but "
                             f"its folder {lacks}; nothing was kept")
        os.rename(os.path.join(staging, DOWNLOADS[dataset][1]), folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


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
        fetch(dataset, args.data_dir, getattr(download, function))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
