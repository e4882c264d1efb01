-- What a `run_tree` grant of an approval covers: the rule that asked (`rule:<text>`), or the
-- exact call (`call:<tool>:<hash of its input>`) when the permission mode asked. Older
-- approvals have none; their grants keep covering the tool.
ALTER TABLE sa_approvals ADD COLUMN grant_scope TEXT;
