"""The ``anlr`` application: the command line and the run it drives, above the library packages.

One concern per module, each importing only the library and the modules listed before it (imports
for type annotations alone excepted):

- :mod:`~anlr_jax.app.assemble`: the one assembly of a method's run from a config (``build_method``:
  layers, optimizer, schedule, and what a method adds to a run, AdaLoRA's regulariser, LoRA-Dash's
  launch), over the library's method table (:mod:`anlr_jax.methods`: layer + optimizer of each
  ``method:``);
- :mod:`~anlr_jax.app.sections`: the typed run config's sections and :class:`RunConfig` (each key
  declared once: type, default, help, allowed values);
- :mod:`~anlr_jax.app.config`: loading it (YAML + ``key=value`` overrides, renamed keys, checked)
  and ``--help``;
- :mod:`~anlr_jax.app.identity`: a run's identity (the settings that determine its trajectory);
- :mod:`~anlr_jax.app.split_files`: files shipped in pieces over several packages (the offline judge),
  joined once into the cache (``anlr judge-model``);
- :mod:`~anlr_jax.app.paths`: ``asset://`` / ``package://`` paths, placeholders, shipped configs;
- :mod:`~anlr_jax.app.dryrun`: ``anlr train --dry_run`` (memory per device of a config and mesh);
- :mod:`~anlr_jax.app.report`: log lines, loss plots, tables, JSON files (process 0 writes);
- :mod:`~anlr_jax.app.model`: base model, adapter layers, adapter files;
- :mod:`~anlr_jax.app.text_generation`: batched generation with the training tokenisation of prompts;
- :mod:`~anlr_jax.app.judge_client`: the HTTP client of a judge behind an endpoint (retries);
- :mod:`~anlr_jax.app.judge`: MT-Bench answers and the LLM judge (``anlr judge``);
- :mod:`~anlr_jax.app.evaluate`: eval tasks, ``anlr eval``, ``anlr generate``;
- :mod:`~anlr_jax.app.chat_request`: the checks of a chat completion request;
- :mod:`~anlr_jax.app.batch_engine`: continuous batching of generation requests;
- :mod:`~anlr_jax.app.serve`: ``anlr serve`` (a model behind an OpenAI-compatible chat endpoint);
- :mod:`~anlr_jax.app.train`: ``anlr train`` (one method or several compared);
- :mod:`~anlr_jax.app.export`: ``anlr export`` (PEFT adapter or merged model);
- :mod:`~anlr_jax.app.analysis_cli`: ``anlr analyze`` and ``anlr sweep``;
- :mod:`~anlr_jax.app.distributed_job`: ``anlr train`` as a ``jax.distributed`` job;
- :mod:`~anlr_jax.app.cli`: the ``anlr`` command;
- :mod:`~anlr_jax.app.launch`: the process entry (huge-page ``malloc``, then the command).

The file names inside a run directory are those of :mod:`anlr_jax.rundir`.
"""
