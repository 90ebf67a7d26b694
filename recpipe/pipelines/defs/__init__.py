"""The pipelines' declarations: each one's schedule tables, options, config rules, memory
facts and the dotted path of its engine class (``recpipe.runtime.definition``). Nothing
here imports torch: the config validates these options, and ``recpipe schedule`` and
``recpipe plan`` read them, without loading the engine."""
