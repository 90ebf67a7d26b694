"""Checkpoints: saving, finding, verifying and loading them, and converting TorchRec's.

``store`` holds the DCP layout, save, resume and retention (``save_checkpoint``,
``load_checkpoint``, ``latest_checkpoint``, ``TrainPosition``); ``reader`` reads a
checkpoint without running code it names; ``integrity`` records and checks every file's
size and CRC-32 (``recpipe checkpoint verify``); ``convert`` moves checkpoints between
TorchRec and recpipe (``recpipe checkpoint convert``).

The package sits below the pre-launch checks (``recpipe.preflight`` checks the checkpoint a
resume starts from) and the trainer, which saves and loads through it. This file imports
nothing, so that importing one module of the package (``integrity``, which imports no torch)
runs no other.
"""
