"""relayr's Celery shell: the app (:mod:`tasks.app`), the run task (:mod:`tasks.runs`) and each
pool process's event loop (:mod:`tasks.worker`). Thin by design: ids in, one call into
:mod:`relayr.execution.executor`, typed outcomes out; everything else lives in :mod:`relayr`."""
