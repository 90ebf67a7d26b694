"""The speed features' declarations: each one's options section, the capabilities it needs,
its config rules and the dotted path of its ``apply`` (``recpipe.speedups.definition``).
Nothing here imports torch: the config validates these sections, and ``recpipe plan`` and
``recpipe schedule`` read them, without loading the implementations."""
