//! Compiles `proto/` with protox (no system protoc), refuses to build when an RPC is
//! not classified by `runplane.options.v1.policy`, writes the descriptor set for
//! reflection, generates the per-method policy table and the tonic code.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest.join("../../proto").canonicalize()?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    println!("cargo:rerun-if-changed={}", proto_root.display());

    let mut files = Vec::new();
    collect_protos(&proto_root, &proto_root, &mut files)?;
    files.sort();
    for f in &files {
        println!("cargo:rerun-if-changed={}", proto_root.join(f).display());
    }

    let mut compiler = protox::Compiler::new([&proto_root])?;
    compiler.include_imports(true).include_source_info(true);
    compiler
        .open_files(&files)
        .map_err(|e| anyhow::anyhow!("{e:?}"))
        .context("compiling proto/")?;

    // The check reads the custom option through prost-reflect; prost's own descriptor
    // types would drop it.
    let pool = compiler.descriptor_pool();
    let methods = match runplane_proto_policy::check::check(&pool) {
        Ok(methods) => methods,
        Err(e) => bail!("{e}"),
    };
    std::fs::write(
        out_dir.join("method_policies.rs"),
        runplane_proto_policy::check::render_table(&methods),
    )?;

    // Encoded by protox, so the options (and their extensions) survive for reflection.
    std::fs::write(
        out_dir.join("runplane_descriptor.bin"),
        compiler.encode_file_descriptor_set(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // A service a later issue has not implemented answers UNIMPLEMENTED.
        .generate_default_stubs(true)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}

fn collect_protos(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_protos(root, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            let rel = path.strip_prefix(root)?.to_string_lossy().into_owned();
            out.push(rel);
        }
    }
    Ok(())
}
