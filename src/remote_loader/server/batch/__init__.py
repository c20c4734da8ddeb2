"""The batch vocabulary between the stages: the messages between the server and its workers
(`messages`), what an engine hands a Run for each task (`delivery`), a batch's hold on its
worker's slot (`lease`), what the send stage hands over (`outgoing`), batches that lie on the
node that made them (`node_batch`) and the directory of those nodes (`node_directory`). Imports
only `protos` and the leaves (`errors`).
"""
