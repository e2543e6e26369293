// Validates Kubernetes objects (a JSON array on stdin) against the Kubernetes API schemas of
// the npm package kubernetes-models: prints one line per object, exits 1 on the first invalid
// one. Used by tests/deploy_test.py; NODE_PATH must hold kubernetes-models
// (deploy/install_deps.sh installs it under /usr/local/lib/dbs-k8s-validator).
"use strict";
const fs = require("fs");

const MODULES = {
  "v1": "kubernetes-models/v1",
  "apps/v1": "kubernetes-models/apps/v1",
  "batch/v1": "kubernetes-models/batch/v1",
  "networking.k8s.io/v1": "kubernetes-models/networking.k8s.io/v1",
};

const objects = JSON.parse(fs.readFileSync(0, "utf8"));
let bad = 0;
for (const obj of objects) {
  const where = `${obj.apiVersion} ${obj.kind} ${obj.metadata && obj.metadata.name}`;
  const module = MODULES[obj.apiVersion];
  if (!module) {
    console.log(`UNKNOWN ${where}: no schema module for this apiVersion`);
    bad++;
    continue;
  }
  const Kind = require(module)[obj.kind];
  if (!Kind) {
    console.log(`UNKNOWN ${where}: no such kind`);
    bad++;
    continue;
  }
  try {
    new Kind(obj).validate();
    console.log(`valid ${where}`);
  } catch (e) {
    console.log(`INVALID ${where}: ${e.message}`);
    bad++;
  }
}
process.exit(bad === 0 ? 0 : 1);
