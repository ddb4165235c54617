//! The one `blockplane` executable: the service, its workers, the CSI
//! driver, the dashboard's port-forward and the CLI ([`cli`]).

mod cli;

/// The build mark (`blockplane_system::build`: `MARK_SECTION`, `MARK_LEN`
/// bytes): the commit this binary was built from, read back from the file
/// by its section name.
#[used]
#[unsafe(link_section = ".blockplane_build")]
static BUILD_MARK: [u8; 64] = include!(concat!(env!("OUT_DIR"), "/mark.rs"));

#[cfg(test)]
#[test]
fn the_mark_is_where_and_as_long_as_the_reader_looks() {
    assert_eq!(BUILD_MARK.len(), blockplane_system::build::MARK_LEN);
    assert_eq!(".blockplane_build", blockplane_system::build::MARK_SECTION);
}

fn main() -> std::process::ExitCode {
    // Referenced, so that no linker drops the section.
    std::hint::black_box(&BUILD_MARK);
    cli::main()
}
