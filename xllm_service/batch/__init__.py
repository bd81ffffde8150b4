"""The OpenAI Batch API on the service: JSONL files of requests run as offline work.

  files.py    FileStore: uploaded and produced files (/v1/files), on disk
  state.py    BatchStatus and its transition table; BatchRecord (what /v1/batches shows)
  store.py    BatchStore: batch records and each batch's journal of answered lines, on disk
  lines.py    one input line: checked, or the error record that answers it
  runner.py   BatchRunner: the master runs every open batch's lines as offline requests
  service.py  BatchService: the routes and the runner on one service process
  api.py      the /v1/files and /v1/batches routes

State lives on disk (`ServiceConfig.batch_dir`), not in etcd: batch files are bulk data
(etcd caps a value at 1.5 MiB and is sized for coordination), and a master that takes
over must read the input files anyway, so the directory is shared by every service of the
cluster (a shared volume across hosts); etcd only decides which service runs the batches
(the master election). See runner.py for what a failover keeps.
"""
