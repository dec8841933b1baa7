"""``vasso-selftest``: what the CPU-only tests of this project cannot check, checked in
minutes on the user's own hardware, torch build, NCCL, fairseq and DomainBed."""
