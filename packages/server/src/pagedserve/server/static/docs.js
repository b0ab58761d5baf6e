// Renders /openapi.json: one card per operation (its body and answer schemas), then every
// component schema with its fields. Plain DOM, no framework: the page must work offline.
"use strict";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

function refName(ref) { return ref.split("/").pop(); }

function typeOf(schema) {
  if (!schema) return el("span", {class: "type"}, "any");
  if (schema.$ref) return el("a", {href: "#schema-" + refName(schema.$ref), class: "type"}, refName(schema.$ref));
  for (const key of ["anyOf", "oneOf"]) {
    if (schema[key]) {
      const out = el("span", {class: "type"});
      schema[key].forEach((member, i) => { if (i) out.append(" | "); out.append(typeOf(member)); });
      return out;
    }
  }
  if (schema.type === "array") {
    const out = el("span", {class: "type"}, "list[");
    out.append(typeOf(schema.items), "]");
    return out;
  }
  if (schema.const !== undefined) return el("span", {class: "type"}, JSON.stringify(schema.const));
  if (schema.enum) return el("span", {class: "type"}, schema.enum.map((v) => JSON.stringify(v)).join(" | "));
  if (schema.type === "object" && schema.additionalProperties) {
    const out = el("span", {class: "type"}, "dict[str, ");
    out.append(typeOf(schema.additionalProperties), "]");
    return out;
  }
  return el("span", {class: "type"}, schema.type || "any");
}

function fieldsTable(schema) {
  const table = el("table", {}, el("tr", {}, el("th", {}, "field"), el("th", {}, "type"), el("th", {}, "default")));
  const required = new Set(schema.required || []);
  for (const [name, field] of Object.entries(schema.properties || {})) {
    const fallback = "default" in field ? JSON.stringify(field.default) : (required.has(name) ? "required" : "");
    table.append(el("tr", {}, el("td", {}, el("code", {}, name)), el("td", {}, typeOf(field)), el("td", {}, fallback)));
  }
  return table;
}

function operationCard(path, method, op) {
  const card = el("div", {class: "op", id: op.operationId});
  const head = el("div", {}, el("span", {class: "method " + method}, method), el("span", {class: "path"}, path));
  if (op.security && op.security.length === 0) head.append(el("span", {class: "open"}, "no key needed"));
  card.append(head, el("p", {}, op.summary || ""));
  const body = op.requestBody && op.requestBody.content["application/json"];
  if (body) card.append(el("div", {}, "Body: ", typeOf(body.schema)));
  for (const [media, answer] of Object.entries(op.responses["200"].content || {})) {
    card.append(el("div", {}, "200 ", el("code", {}, media), ": ", typeOf(answer.schema)));
  }
  return card;
}

async function render() {
  const spec = await (await fetch("/openapi.json")).json();
  document.getElementById("info").textContent =
    `${spec.info.title} ${spec.info.version}, OpenAPI ${spec.openapi}: ${spec.info.description}`;
  const toc = document.getElementById("toc");
  const operations = document.getElementById("operations");
  for (const [path, methods] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      operations.append(operationCard(path, method, op));
      toc.append(el("a", {href: "#" + op.operationId}, method.toUpperCase() + " " + path));
    }
  }
  const schemas = document.getElementById("schemas");
  for (const [name, schema] of Object.entries(spec.components.schemas)) {
    const block = el("div", {class: "schema", id: "schema-" + name}, el("h3", {}, name));
    if (schema.description) block.append(el("p", {}, schema.description));
    block.append(schema.properties ? fieldsTable(schema) : typeOf(schema));
    schemas.append(block);
  }
  document.body.dataset.rendered = "true";
}

render().catch((error) => { document.getElementById("info").textContent = "Could not load the schema: " + error; });
